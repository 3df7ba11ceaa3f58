-- node_heartbeat.lua: register a node or renew its liveness.
--
-- KEYS[1]  {<prefix>:v2:registry}:nodes  HASH  node -> "<incarnation> <last heartbeat ms> <ttl ms> <state>"
-- ARGV[1]  node name
-- ARGV[2]  incarnation (grows with every start of the node's daemon)
-- ARGV[3]  ttl in ms: the node is gone once this long passes without a heartbeat
-- Returns  {1, incarnation} when recorded; {0, newer incarnation} when a newer incarnation of this node
--          holds the name (this caller is a stale instance and should stop claiming it).
-- Time is Redis's own (TIME), so hosts with skewed clocks agree.
local nodes = KEYS[1]
local node, incarnation, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local current = redis.call('HGET', nodes, node)
if current then
  local inc, _, _, state = string.match(current, '^(%S+) (%S+) (%S+) (%S+)$')
  if state == 'up' and tonumber(inc) > incarnation then
    return {0, inc}
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', nodes, node, string.format('%d %d %d up', incarnation, now, ttl))
return {1, tostring(incarnation)}
