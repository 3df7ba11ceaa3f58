-- node_mark.lua: set one node's record in the registry or in one warm-table shard's copy of it.
--
-- KEYS[1]  {<prefix>:v2:warm:<shard>}:nodes  HASH  node -> "<incarnation> <last heartbeat ms> <ttl ms>
--          <state>" (a shard's copy; the registry, {<prefix>:v2:registry}:nodes, takes the same calls)
-- ARGV[1]  node name
-- ARGV[2]  incarnation
-- ARGV[3]  ttl in ms
-- ARGV[4]  what to do: "up" (a heartbeat, stamped with this Redis's TIME, unless a newer incarnation
--          that is live holds the name: liveness.lib.lua), "forgotten" (lookups stop answering the node; the incarnation
--          is kept), "drop" (remove the record if it is still "forgotten"), "copy" (write ARGV[5], a
--          whole record, where there is none: the migration from schema version 1)
-- ARGV[5]  the record, for "copy"
-- Returns  1 when the record changed, else 0.
local nodes = KEYS[1]
local node, incarnation, ttl, what = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
--! include liveness.lib.lua
local current = redis.call('HGET', nodes, node)
if what == 'up' then
  if current then
    local inc, _, _, state = string.match(current, '^(%S+) (%S+) (%S+) (%S+)$')
    if state == 'up' and tonumber(inc) > incarnation and live(current) then return 0 end
  end
  redis.call('HSET', nodes, node, string.format('%d %d %d up', incarnation, clock_ms(), ttl))
  return 1
elseif what == 'forgotten' then
  local inc = tostring(incarnation)
  if current then inc = string.match(current, '^(%S+)') end
  redis.call('HSET', nodes, node, inc .. ' 0 0 forgotten')
  return 1
elseif what == 'drop' then
  if current and string.match(current, 'forgotten$') then
    redis.call('HDEL', nodes, node)
    return 1
  end
  return 0
elseif what == 'copy' then
  if current then return 0 end
  redis.call('HSET', nodes, node, ARGV[5])
  return 1
end
return redis.error_reply('node_mark.lua: unknown action ' .. tostring(what))
