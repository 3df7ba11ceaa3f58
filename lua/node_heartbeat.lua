-- node_heartbeat.lua: register a node or renew its liveness.
--
-- KEYS[1]  {<prefix>:v2:registry}:nodes  HASH  node -> "<incarnation> <last heartbeat ms> <ttl ms> <state>"
-- ARGV[1]  node name
-- ARGV[2]  incarnation (grows with every start of the node's daemon)
-- ARGV[3]  ttl in ms: the node is gone once this long passes without a heartbeat
-- Returns  {1, incarnation} when recorded; {0, newer incarnation} when a newer incarnation of this node
--          holds the name and is live (this caller is a stale instance and should stop claiming it).
--          A newer incarnation whose heartbeat expired holds nothing: incarnations are start times of
--          the host that ran the node, and a name that moves to a host whose clock is behind (or a
--          clock stepped back) must not be locked out for good by a record nobody renews.
-- Time is Redis's own (TIME, liveness.lib.lua), so hosts with skewed clocks agree.
local nodes = KEYS[1]
local node, incarnation, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
--! include liveness.lib.lua
local current = redis.call('HGET', nodes, node)
if current then
  local inc, _, _, state = string.match(current, '^(%S+) (%S+) (%S+) (%S+)$')
  if state == 'up' and tonumber(inc) > incarnation and live(current) then
    return {0, inc}
  end
end
redis.call('HSET', nodes, node, string.format('%d %d %d up', incarnation, clock_ms(), ttl))
return {1, tostring(incarnation)}
