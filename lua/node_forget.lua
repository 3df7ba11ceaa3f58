-- node_forget.lua: one bounded step of removing a node and every prefix it holds.
--
-- KEYS[1]  {<prefix>:v1:warm}:prefixes  HASH  8-byte chain hash -> "<at> <node>"
-- KEYS[2]  {<prefix>:v1:warm}:ages      ZSET  chain hash, scored by <at>
-- KEYS[3]  {<prefix>:v1:warm}:nodes     HASH  node -> "<incarnation> <last heartbeat ms> <ttl ms> <state>"
-- ARGV[1]  node name
-- ARGV[2]  HSCAN cursor ("0" to start)
-- ARGV[3]  how many fields to scan in this step
-- Returns  {next cursor ("0" when done), prefixes removed in this step}
--
-- The first step marks the node "forgotten" so warm_warmest.lua stops answering it at once; the last
-- step drops its registration. A heartbeat of the node in between registers it again.
local prefixes, ages, nodes = KEYS[1], KEYS[2], KEYS[3]
local node, cursor, count = ARGV[1], ARGV[2], tonumber(ARGV[3])
if cursor == '0' then
  local current = redis.call('HGET', nodes, node)
  local inc = '0'
  if current then inc = string.match(current, '^(%S+)') end
  redis.call('HSET', nodes, node, inc .. ' 0 0 forgotten')
end
local scan = redis.call('HSCAN', prefixes, cursor, 'COUNT', count)
local fields = scan[2]
local victims = {}
local suffix = ' ' .. node
for i = 1, #fields, 2 do
  local v = fields[i + 1]
  if string.sub(v, -#suffix) == suffix then victims[#victims + 1] = fields[i] end
end
if #victims > 0 then
  redis.call('HDEL', prefixes, unpack(victims))
  redis.call('ZREM', ages, unpack(victims))
end
if scan[1] == '0' then
  local current = redis.call('HGET', nodes, node)
  if current and string.match(current, 'forgotten$') then redis.call('HDEL', nodes, node) end
end
return {scan[1], #victims}
