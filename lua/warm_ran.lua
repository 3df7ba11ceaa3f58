-- warm_ran.lua: record that a node ran one or more prompts (the seed's Warm::ran, atomically), in one
-- shard of the warm table (every prompt passed shares the shard: the first hash of its chain picks it).
--
-- KEYS[1]  {<prefix>:v2:warm:<shard>}:prefixes  HASH  8-byte chain hash -> "<at> <node>"
-- KEYS[2]  {<prefix>:v2:warm:<shard>}:ages      ZSET  chain hash, scored by <at>
-- KEYS[3]  {<prefix>:v2:warm:<shard>}:clock     STRING counter, one tick per prompt
-- KEYS[4]  {<prefix>:v2:warm:<shard>}:batch:<id> STRING this call's marker, set for ARGV[4] ms: a call sent
--          again with the same id (its first answer was lost to a timeout) changes nothing
-- ARGV[1]  node name (letters, digits, '.', '_', '-')
-- ARGV[2]  max_prefixes of this shard: past this many, the shard's oldest eighth is dropped
-- ARGV[3]  hash length in bytes (8)
-- ARGV[4]  how long the marker lives, in ms
-- ARGV[5…] one chain per prompt: the concatenated block hashes of that prompt
-- Returns  the number of prefixes written, or -1 when this batch id was applied already.
--
-- Every prefix of a prompt is (re)stamped with a fresh tick, so along any chain the ticks never increase
-- with length; dropping the oldest ticks therefore keeps each chain's remembered prefixes contiguous
-- from its first block (what warm_warmest.lua's binary search relies on).
local prefixes, ages, clock, marker = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local node = ARGV[1]
local max_prefixes = tonumber(ARGV[2])
local hl = tonumber(ARGV[3])
if not redis.call('SET', marker, '1', 'NX', 'PX', tonumber(ARGV[4])) then return -1 end
local BATCH = 1000
local written = 0

local function evict_oldest_eighth()
  local cut = redis.call('ZRANGE', ages, math.floor(max_prefixes / 8), math.floor(max_prefixes / 8), 'WITHSCORES')
  if #cut == 0 then return end
  local limit = cut[2]
  while true do
    local victims = redis.call('ZRANGEBYSCORE', ages, '-inf', limit, 'LIMIT', 0, BATCH)
    if #victims == 0 then break end
    redis.call('HDEL', prefixes, unpack(victims))
    redis.call('ZREM', ages, unpack(victims))
  end
end

for i = 5, #ARGV do
  local chain = ARGV[i]
  local n = math.floor(#chain / hl)
  if n > 0 then
    local at = redis.call('INCR', clock)
    local value = at .. ' ' .. node
    local j = 0
    while j < n do
      local hset, zadd = {}, {}
      local stop = math.min(n, j + BATCH)
      for k = j, stop - 1 do
        local h = string.sub(chain, k * hl + 1, (k + 1) * hl)
        hset[#hset + 1] = h
        hset[#hset + 1] = value
        zadd[#zadd + 1] = at
        zadd[#zadd + 1] = h
      end
      redis.call('HSET', prefixes, unpack(hset))
      redis.call('ZADD', ages, unpack(zadd))
      j = stop
    end
    written = written + n
    if redis.call('HLEN', prefixes) > max_prefixes then
      evict_oldest_eighth()
    end
  end
end
return written
