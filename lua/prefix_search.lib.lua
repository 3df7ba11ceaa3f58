-- prefix_search.lib.lua: the search warm_warmest.lua and warm_route.lua share, one copy: the longest
-- remembered prefix of a prompt's chain, and the start of each run one ran() stamped.
-- Not a script of its own: skippyd.cluster.coordination puts its text in place of the line of a script
-- that includes it, before the script goes to Redis (`skippyd warm script` prints what Redis runs).
--
-- KEYS     none of its own: it reads the including script's prefixes hash (its KEYS[1])
-- ARGV     none of its own: it needs these locals in scope where it is included: prefixes (the hash's
--          name), chain (the concatenated block hashes), hl (a hash's length), min_blocks, n (blocks)
-- Returns  nothing: it defines seen, fetch, present, parse, boundary and longest_from_end
--
-- Remembered prefixes of a chain are contiguous from block 1 (see warm_ran.lua), so the longest one is
-- the boundary of a monotone predicate, found as the seed's linear scan finds it but in O(log n)
-- lookups: one HMGET asks for block min_blocks (absent: no answer), the whole prompt (present: the
-- answer) and a short gallop down from the end (a conversation's next turn adds a few blocks to a prefix
-- that is warm); then each HMGET asks for FANOUT evenly spaced blocks inside the bracket left. Measured
-- on 2,048 blocks: a fan-out of 1 to 7 costs Redis the same, 15 and up more (each field costs about as
-- much as a call saves); what remains is mostly the argument itself (about 1.3 ns a byte in Redis).
-- Ticks never increase along the chain, so the prefixes one ran() stamped form a contiguous run, whose
-- start the same search finds on ticks.
local FANOUT = 3

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
