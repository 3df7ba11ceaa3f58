-- liveness.lib.lua: whether a registered node is live, on Redis's own clock, for every script that asks
-- (warm_warmest.lua, warm_route.lua, node_heartbeat.lua, node_mark.lua). Not a script of its own:
-- skippyd.cluster.coordination puts its text in place of the line of a script that includes it, before
-- the script goes to Redis.
--
-- KEYS     none of its own
-- ARGV     none of its own
-- Returns  nothing: it defines clock_ms and live
--
-- A record is "<incarnation> <last heartbeat ms> <ttl ms> <state>": the node is live while its state is
-- "up" and its last heartbeat is within its ttl on this Redis's clock (TIME, read once per call, when
-- first needed: hosts with skewed clocks agree). A node never registered (no record) is live (static
-- setups that feed ran() themselves); a forgotten one's record stays ("forgotten") until it heartbeats
-- again, so it is never taken as live.
local now_ms = nil
local function clock_ms()
  if not now_ms then
    local t = redis.call('TIME')
    now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return now_ms
end
local function live(record)
  if not record then return true end
  local _, last, ttl, state = string.match(record, '^(%S+) (%S+) (%S+) (%S+)$')
  return state == 'up' and (clock_ms() - tonumber(last)) <= tonumber(ttl)
end
