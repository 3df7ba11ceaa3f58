-- node_forget.lua: one bounded step of removing every prefix a node holds from one warm-table shard.
--
-- KEYS[1]  {<prefix>:v2:warm:<shard>}:prefixes  HASH  8-byte chain hash -> "<at> <node>"
-- KEYS[2]  {<prefix>:v2:warm:<shard>}:ages      ZSET  chain hash, scored by <at>
-- ARGV[1]  node name
-- ARGV[2]  HSCAN cursor ("0" to start)
-- ARGV[3]  how many fields to scan in this step
-- Returns  {next cursor ("0" when done), prefixes removed in this step}
--
-- WarmTable.forget marks the node "forgotten" in every shard's copy of it and then in the registry
-- (node_mark.lua) before the first step, so lookups stop answering it at once, and drops its
-- registration after the last step of the last shard.
local prefixes, ages = KEYS[1], KEYS[2]
local node, cursor, count = ARGV[1], ARGV[2], tonumber(ARGV[3])
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
return {scan[1], #victims}
