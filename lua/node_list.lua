-- node_list.lua: every registered node with its liveness, on Redis's clock.
--
-- KEYS[1]  {<prefix>:v2:registry}:nodes  HASH  node -> "<incarnation> <last heartbeat ms> <ttl ms> <state>"
-- Returns  {now_ms, node1, record1, node2, record2, …}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {tostring(now)}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all do out[#out + 1] = all[i] end
return out
