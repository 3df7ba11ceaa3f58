-- promo_settle.lua: a promotion was attempted; its observation becomes terminal (the seed's promote).
--
-- KEYS[1]  {<prefix>:v1:promo:<scope>}:obs  HASH  payload digest -> "<first seen ms> <hits> <terminal 0|1>"
-- ARGV[1]  payload digest
-- Returns  1 if there was an observation to settle, else 0.
local current = redis.call('HGET', KEYS[1], ARGV[1])
if not current then return 0 end
local first, hits = string.match(current, '^(%S+) (%S+) ')
redis.call('HSET', KEYS[1], ARGV[1], first .. ' ' .. hits .. ' 1')
return 1
