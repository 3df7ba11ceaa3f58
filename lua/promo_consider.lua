-- promo_consider.lua: count observations toward a second-hit decision (the seed's should_promote, shared
-- by every process and host that uses the same scope): L3 fills toward promotion into L2, and, in their
-- own scope, block puts toward admission into L3. One call counts a batch, each item in order.
--
-- KEYS[1]  {<prefix>:v1:promo:<scope>}:obs   HASH  observed key -> "<first seen ms> <hits> <terminal 0|1>"
-- KEYS[2]  {<prefix>:v1:promo:<scope>}:ages  ZSET  observed key, scored by first seen ms
-- ARGV[1]  window ms: observations older than this are forgotten (default 10 minutes)
-- ARGV[2]  max_bytes: larger payloads are refused for good (default 64 MiB)
-- ARGV[3]  worth_tokens: items this long say yes on first sight (default 4096)
-- ARGV[4]  max_observations: the oldest (ties by key) makes room for a new one (default 4096)
-- ARGV[5…] triples, one per item: key (an entry's 64 hex payload digest, or a block's hex key),
--          token_count, payload bytes
-- Returns  an array with one 1 (promote / admit) or 0 per item, in order.
--
-- Seed semantics: hits saturate at 255; a terminal observation (promotion attempted, or payload too
-- large) never says yes again within the window; until then every observation after the first says
-- yes, so a promotion dropped by a full worker queue is retried on the next fill.
local obs, ages = KEYS[1], KEYS[2]
local window, max_bytes = tonumber(ARGV[1]), tonumber(ARGV[2])
local worth_tokens, max_observations = tonumber(ARGV[3]), tonumber(ARGV[4])

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

local function consider(key, token_count, payload_bytes)
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
end

local answers = {}
for i = 5, #ARGV, 3 do
  answers[#answers + 1] = consider(ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]))
end
return answers
