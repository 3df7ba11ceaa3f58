-- warm_warmest.lua: which live node ran the longest remembered prefix of a prompt (the seed's
-- Warm::warmest, with liveness), in O(log n) lookups for an n-block prompt.
--
-- KEYS[1]  {<prefix>:warm}:prefixes  HASH  8-byte chain hash -> "<at> <node>"
-- KEYS[2]  {<prefix>:warm}:nodes     HASH  node -> "<incarnation> <last heartbeat ms> <ttl ms> <state>"
-- ARGV[1]  the prompt's chain: concatenated block hashes, block 1 first
-- ARGV[2]  hash length in bytes (8)
-- ARGV[3]  min_blocks: a shorter answer is no answer
-- ARGV[4]  how many runs of gone nodes to step over before giving up
-- Returns  {node, blocks} or nil.
--
-- Remembered prefixes of a chain are contiguous from block 1 (see warm_ran.lua), so the longest one is
-- the boundary of a monotone predicate, found as the seed's linear scan finds it but in O(log n)
-- lookups: first block min_blocks (absent: no answer, one lookup), then the whole prompt (present: two
-- lookups), then up to four galloping steps down from the end (a conversation's next turn adds a few
-- blocks to a prefix that is warm), then a binary search inside the bracket left.
-- Ticks never increase along the chain, so the prefixes one ran() stamped form a contiguous run; when
-- its node is gone (heartbeat expired, or forgotten) a binary search finds where that run starts and
-- the answer steps below it. Nodes that never registered are taken as live (static setups that feed
-- ran() themselves).
local prefixes, nodes = KEYS[1], KEYS[2]
local chain = ARGV[1]
local hl = tonumber(ARGV[2])
local min_blocks = tonumber(ARGV[3])
local max_dead_runs = tonumber(ARGV[4])
local n = math.floor(#chain / hl)
if n < min_blocks then return nil end

local seen = {}
local function value(k)
  local v = seen[k]
  if v == nil then
    v = redis.call('HGET', prefixes, string.sub(chain, (k - 1) * hl + 1, k * hl)) or false
    seen[k] = v
  end
  return v
end
local function parse(v)
  local space = string.find(v, ' ', 1, true)
  return tonumber(string.sub(v, 1, space - 1)), string.sub(v, space + 1)
end
-- the largest k in [0, hi] whose prefix is remembered (0: none)
local function longest(hi)
  local lo = 0
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    if value(mid) then lo = mid else hi = mid - 1 end
  end
  return lo
end
-- the longest remembered prefix of the whole chain, or 0 when it is shorter than min_blocks
local function longest_from_end()
  if not value(min_blocks) then return 0 end
  if value(n) then return n end
  local lo, hi, step = min_blocks, n, 1  -- value(lo) is remembered, value(hi) is not
  for _ = 1, 4 do  -- a short gallop from the end: a conversation's next turn adds a few blocks
    if hi - step <= lo then break end
    if value(hi - step) then lo = hi - step break end
    hi = hi - step
    step = step * 2
  end
  while hi - lo > 1 do
    local mid = math.floor((lo + hi) / 2)
    if value(mid) then lo = mid else hi = mid end
  end
  return lo
end

local now = nil
local alive = {}
local function is_alive(node)
  local known = alive[node]
  if known ~= nil then return known end
  local reg = redis.call('HGET', nodes, node)
  local ok = true
  if reg then
    if not now then
      local t = redis.call('TIME')
      now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    end
    local _, last, ttl, state = string.match(reg, '^(%S+) (%S+) (%S+) (%S+)$')
    ok = state == 'up' and (now - tonumber(last)) <= tonumber(ttl)
  end
  alive[node] = ok
  return ok
end

local k = longest_from_end()
local dead_runs = 0
while k >= min_blocks do
  local at, node = parse(value(k))
  if is_alive(node) then return {node, k} end
  dead_runs = dead_runs + 1
  if dead_runs > max_dead_runs then return nil end
  -- the first block of this run: the smallest j <= k stamped with the same tick
  local lo, hi = 1, k
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    local v = value(mid)
    if v and parse(v) > at then lo = mid + 1 else hi = mid end
  end
  k = longest(lo - 1)
end
return nil
