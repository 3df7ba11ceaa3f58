-- warm_route.lua: for each candidate node, whether it is live and the longest remembered prefix of a
-- prompt that it ran (what WarmTable.route weighs against load): one call, one shard, one round trip.
--
-- KEYS[1]  {<prefix>:v2:warm:<shard>}:prefixes  HASH  8-byte chain hash -> "<at> <node>"
-- KEYS[2]  {<prefix>:v2:warm:<shard>}:nodes     HASH  node -> "<incarnation> <last heartbeat ms> <ttl ms>
--          <state>": this shard's copy of the registry (every heartbeat writes it to each shard)
-- ARGV[1]  the prompt's chain: concatenated block hashes, block 1 first (may be empty)
-- ARGV[2]  hash length in bytes (8)
-- ARGV[3]  min_blocks: a shorter prefix counts as 0
-- ARGV[4]  how many runs of the chain (one ran() each) to step through at most
-- ARGV[5]  how far to search: "all" (every live candidate's prefix), "warmest" (stop at the warmest
--          live candidate) or "balance" (stop there too unless the loads make it overloaded, then go on
--          until every least-loaded candidate's prefix is known: all WarmTable.route needs)
-- ARGV[6]  balance_abs, ARGV[7] balance_rel: the thresholds of "balance" (as WarmTable.route applies them)
-- ARGV[8]  m, the number of loads that follow
-- ARGV[9…] m pairs (node, load), then the candidate nodes; with none, every live node registered in this
--          shard's copy
-- Returns  {node, live (1|0), blocks, node, live, blocks, …}: one triple per candidate, in the order
--          given (registered nodes in registry order when none were given; only live ones then). Blocks
--          of a candidate the search stopped before reaching are 0.
--
-- Liveness and the search are liveness.lib.lua's and prefix_search.lib.lua's (included below), as in warm_warmest.lua: a
-- registered node is live while its state is "up" and its last heartbeat is within its ttl on this
-- Redis's clock; a node never registered is live (static setups); a forgotten node is not. A node's blocks: the remembered prefix of the chain is contiguous from block
-- 1 and its ticks never increase with length (warm_ran.lua), so it is a sequence of runs, one per ran()
-- that stamped it; the search finds the longest prefix as warmest does, then steps down run by run
-- (each run's start found by a binary search on ticks), giving each candidate the end of the first run
-- it owns. Candidates missing from the loads have load 0.
local prefixes, nodes = KEYS[1], KEYS[2]
local chain = ARGV[1]
local hl = tonumber(ARGV[2])
local min_blocks = tonumber(ARGV[3])
local max_runs = tonumber(ARGV[4])
local mode = ARGV[5]
local balance_abs, balance_rel = tonumber(ARGV[6]), tonumber(ARGV[7])
local m = tonumber(ARGV[8])
local load = {}
for i = 9, 8 + 2 * m, 2 do load[ARGV[i]] = tonumber(ARGV[i + 1]) end
local first_candidate = 9 + 2 * m
local n = math.floor(#chain / hl)
--! include liveness.lib.lua
--! include prefix_search.lib.lua

local names, alive = {}, {}
if #ARGV >= first_candidate then
  local asked = {}
  for i = first_candidate, #ARGV do asked[#asked + 1] = ARGV[i] end
  local records = redis.call('HMGET', nodes, unpack(asked))
  for i, name in ipairs(asked) do
    names[i] = name
    alive[i] = live(records[i] or nil)
  end
else
  local all = redis.call('HGETALL', nodes)
  for i = 1, #all, 2 do
    if live(all[i + 1]) then
      names[#names + 1] = all[i]
      alive[#alive + 1] = true
    end
  end
end

local want, remaining = {}, 0  -- live candidate -> its blocks (0 until found)
local least, least_left = nil, 0  -- the lowest load among live candidates, and how many have it
for i, name in ipairs(names) do
  if alive[i] and want[name] == nil then
    want[name] = 0
    remaining = remaining + 1
    local l = load[name] or 0
    if least == nil or l < least then least, least_left = l, 1 elseif l == least then least_left = least_left + 1 end
  end
end
local function overloaded(name)
  local l = load[name] or 0
  return l - least > balance_abs and l > balance_rel * least
end

if n >= min_blocks and remaining > 0 then
  local k = longest_from_end()
  local runs = 0
  local warmest = nil
  while k >= min_blocks and remaining > 0 and runs < max_runs do
    local at, node = parse(seen[k])
    if want[node] == 0 then
      want[node] = k
      remaining = remaining - 1
      if (load[node] or 0) == least then least_left = least_left - 1 end
      if warmest == nil then
        warmest = node
        if mode == 'warmest' or (mode == 'balance' and not overloaded(node)) then break end
      end
    end
    runs = runs + 1
    if remaining == 0 or (mode == 'balance' and warmest ~= nil and least_left == 0) then break end
    -- the run reaches down to min_blocks (fetched already): no other run is long enough to count
    if present(min_blocks) and parse(seen[min_blocks]) == at then break end
    local function newer(j) return seen[j] ~= false and parse(seen[j]) > at end
    k = boundary(0, k, newer)  -- the block before this run's first
    if k >= min_blocks then
      fetch({k})
      if not present(k) then k = boundary(0, k, present) end
    end
  end
end

local out = {}
for i, name in ipairs(names) do
  out[#out + 1] = name
  out[#out + 1] = alive[i] and 1 or 0
  out[#out + 1] = alive[i] and want[name] or 0
end
return out
