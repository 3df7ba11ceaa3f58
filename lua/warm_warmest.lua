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
-- The search (prefix_search.lib.lua, included below) finds the longest remembered prefix in O(log n)
-- lookups. The prefixes one ran() stamped form a contiguous run; when its node is gone (heartbeat
-- expired, or forgotten) the same search finds where that run starts and the answer steps below it.
-- Nodes that never registered are taken as live (static setups that feed ran() themselves); a
-- forgotten node's record stays in the shard copies ("forgotten") until it heartbeats again, so it is
-- never taken as live.
local prefixes, nodes = KEYS[1], KEYS[2]
local chain = ARGV[1]
local hl = tonumber(ARGV[2])
local min_blocks = tonumber(ARGV[3])
local max_dead_runs = tonumber(ARGV[4])
local n = math.floor(#chain / hl)
if n < min_blocks then return nil end
--! include liveness.lib.lua
--! include prefix_search.lib.lua

local alive = {}
local function is_alive(node)
  local known = alive[node]
  if known == nil then
    known = live(redis.call('HGET', nodes, node) or nil)
    alive[node] = known
  end
  return known
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
