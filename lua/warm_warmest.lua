-- warm_warmest.lua: which live node ran the longest remembered prefix of a prompt (the seed's
-- Warm::warmest, with liveness), in O(log n) lookups made in a few HMGETs for an n-block prompt.
--
-- KEYS[1]  {<prefix>:v2:warm:<shard>}:prefixes  HASH  8-byte chain hash -> "<at> <node>"
-- KEYS[2]  {<prefix>:v2:warm:<shard>}:nodes     HASH  node -> "<incarnation> <last heartbeat ms> <ttl ms>
--          <state>": this shard's copy of the registry (every heartbeat writes it to each shard)
-- ARGV[1]  the prompt's chain: concatenated block hashes, block 1 first
-- ARGV[2]  hash length in bytes (8)
-- ARGV[3]  min_blocks: a shorter answer is no answer
-- ARGV[4]  how many runs of gone nodes to step over before giving up
-- Returns  {node, blocks} or nil.
--
-- Remembered prefixes of a chain are contiguous from block 1 (see warm_ran.lua), so the longest one is
-- the boundary of a monotone predicate, found as the seed's linear scan finds it but in O(log n)
-- lookups: one HMGET asks for block min_blocks (absent: no answer), the whole prompt (present: the
-- answer) and a short gallop down from the end (a conversation's next turn adds a few blocks to a prefix
-- that is warm); then each HMGET asks for FANOUT evenly spaced blocks inside the bracket left. Measured
-- on 2,048 blocks: a fan-out of 1 to 7 costs Redis the same, 15 and up more (each field costs about as
-- much as a call saves). What remains is mostly the argument itself (about 1.3 ns a byte in Redis).
-- Ticks never increase along the chain, so the prefixes one ran() stamped form a contiguous run; when
-- its node is gone (heartbeat expired, or forgotten) the same search finds where that run starts and
-- the answer steps below it. Nodes that never registered are taken as live (static setups that feed
-- ran() themselves); a forgotten node's record stays in the shard copies ("forgotten") until it
-- heartbeats again, so it is never taken as live.
local prefixes, nodes = KEYS[1], KEYS[2]
local chain = ARGV[1]
local hl = tonumber(ARGV[2])
local min_blocks = tonumber(ARGV[3])
local max_dead_runs = tonumber(ARGV[4])
local FANOUT = 3
local n = math.floor(#chain / hl)
if n < min_blocks then return nil end

local seen = {}  -- block -> "<at> <node>" or false
local function fetch(blocks)
  local fields, wanted = {}, {}
  for _, k in ipairs(blocks) do
    if seen[k] == nil then
      seen[k] = false  -- (a duplicate in blocks is asked once)
      fields[#fields + 1] = string.sub(chain, (k - 1) * hl + 1, k * hl)
      wanted[#wanted + 1] = k
    end
  end
  if #fields > 0 then
    local values = redis.call('HMGET', prefixes, unpack(fields))
    for i, k in ipairs(wanted) do seen[k] = values[i] or false end
  end
end
local function present(k) return seen[k] ~= false end
local function parse(v)
  local space = string.find(v, ' ', 1, true)
  return tonumber(string.sub(v, 1, space - 1)), string.sub(v, space + 1)
end
-- The largest k in [lo, hi) with ok(k), for ok true up to some block and false after it, given that
-- ok(lo) holds (or lo is a floor below the chain) and ok(hi) does not (or hi is a ceiling above it).
local function boundary(lo, hi, ok)
  while hi - lo > 1 do
    local span = hi - lo
    local m = math.min(FANOUT, span - 1)
    local blocks = {}
    for i = 1, m do blocks[i] = lo + math.floor(i * span / (m + 1)) end
    fetch(blocks)
    local next_hi = hi
    for i = 1, m do
      if ok(blocks[i]) then lo = blocks[i] else next_hi = blocks[i] break end
    end
    hi = next_hi
  end
  return lo
end

-- the longest remembered prefix of the whole chain, or 0 when it is shorter than min_blocks
local function longest_from_end()
  local first = {min_blocks, n}
  local offset, step = 0, 1
  for _ = 1, 4 do  -- n - 1, n - 3, n - 7, n - 15
    offset = offset + step
    if n - offset <= min_blocks then break end
    first[#first + 1] = n - offset
    step = step * 2
  end
  fetch(first)
  if not present(min_blocks) then return 0 end
  if present(n) then return n end
  local lo, hi = min_blocks, n
  for i = 3, #first do  -- descending: the first remembered one bounds the answer from below
    if present(first[i]) then lo = first[i] break end
    hi = first[i]
  end
  return boundary(lo, hi, present)
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
  local at, node = parse(seen[k])
  if is_alive(node) then return {node, k} end
  dead_runs = dead_runs + 1
  if dead_runs > max_dead_runs then return nil end
  -- this run's first block: the blocks before it are remembered with newer ticks (a later ran())
  local function newer(j) return seen[j] ~= false and parse(seen[j]) > at end
  local start = boundary(0, k, newer) + 1
  -- the longest remembered prefix below the run (prefix-closed: start - 1 itself, unless forget()
  -- took blocks out of the middle of a chain)
  k = start - 1
  if k >= min_blocks then
    fetch({k})
    if not present(k) then k = boundary(0, k, present) end
  end
end
return nil
