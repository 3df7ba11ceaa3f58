-- promo_consider.lua: count an L3 fill toward promotion into L2 (the seed's should_promote, shared by
-- every process and host that uses the same scope).
--
-- KEYS[1]  {<prefix>:v1:promo:<scope>}:obs   HASH  payload digest -> "<first seen ms> <hits> <terminal 0|1>"
-- KEYS[2]  {<prefix>:v1:promo:<scope>}:ages  ZSET  payload digest, scored by first seen ms
-- ARGV[1]  payload digest (skippyd passes the 64 hex digits of the entry's payload)
-- ARGV[2]  token_count of the entry
-- ARGV[3]  payload bytes
-- ARGV[4]  window ms: observations older than this are forgotten (default 10 minutes)
-- ARGV[5]  max_bytes: larger payloads are refused for good (default 64 MiB)
-- ARGV[6]  worth_tokens: entries this long promote on first sight (default 4096)
-- ARGV[7]  max_observations: the oldest (ties by key) makes room for a new one (default 4096)
-- Returns  1 to promote, 0 not to.
--
-- Seed semantics: hits saturate at 255; a terminal observation (promotion attempted, or payload too
-- large) never promotes again within the window; until then every fill after the first says yes, so a
-- promotion dropped by a full worker queue is retried on the next fill.
local obs, ages = KEYS[1], KEYS[2]
local key = ARGV[1]
local token_count, payload_bytes = tonumber(ARGV[2]), tonumber(ARGV[3])
local window, max_bytes = tonumber(ARGV[4]), tonumber(ARGV[5])
local worth_tokens, max_observations = tonumber(ARGV[6]), tonumber(ARGV[7])

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- retain only observations within the window
local expired = redis.call('ZRANGEBYSCORE', ages, '-inf', '(' .. (now - window))
if #expired > 0 then
  for i = 1, #expired, 1000 do
    local batch = {}
    for j = i, math.min(#expired, i + 999) do batch[#batch + 1] = expired[j] end
    redis.call('HDEL', obs, unpack(batch))
    redis.call('ZREM', ages, unpack(batch))
  end
end

local current = redis.call('HGET', obs, key)
if not current and redis.call('HLEN', obs) >= max_observations then
  local oldest = redis.call('ZRANGE', ages, 0, 0)  -- lowest first-seen, ties by key (ZSET order)
  if #oldest > 0 then
    redis.call('HDEL', obs, oldest[1])
    redis.call('ZREM', ages, oldest[1])
  end
end

local first, hits, terminal = now, 0, 0
if current then
  local f, h, term = string.match(current, '^(%S+) (%S+) (%S+)$')
  first, hits, terminal = tonumber(f), tonumber(h), tonumber(term)
else
  redis.call('ZADD', ages, now, key)
end
if terminal == 1 then return 0 end
hits = math.min(hits + 1, 255)
if payload_bytes > max_bytes then
  redis.call('HSET', obs, key, string.format('%d %d 1', first, hits))
  return 0
end
redis.call('HSET', obs, key, string.format('%d %d 0', first, hits))
if token_count >= worth_tokens or hits >= 2 then return 1 end
return 0
