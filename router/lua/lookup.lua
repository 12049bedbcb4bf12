-- KEYS: live, load, rv, lv, tails, lz   ARGV: pfx, chain (16-byte digests), the caller's load
--   version ('' for none)
-- -> msgpack of {rv, the workers holding block 1: confirmed (but for lapsed leases) and, if
--     live, predicted or by a tail (2-byte codes, confirmed ones with their tier bits; the
--     client drops ids it does not know live),
--     {block, holders, block, holders, ...}: where the confirmed holders change along the walk,
--     from block 1 ('' holders: nobody from there on), per rider 2-byte id | u32 predicted
--     depth, lv, {2-byte id, load, ...} of the loads changed since the caller's version, 1 when
--     that is every load (the caller's version is unknown here), blocks walked}: one string,
--     which the client decodes in C (a nested reply costs a parser call per element)
-- The walk goes block by block from block 1 and returns each change of the confirmed holders
-- once, not a depth per worker: the client derives each worker's consecutive depth from the
-- changes, so a block every worker holds (a common system prompt) costs one string, however
-- many hold it. A worker caches a block only after the ones before it and evicts a chain's tail
-- first, so a block's holders hold every block before it: the same holders at two blocks are
-- the holders of every block between, and past a chunk's worth of blocks with the same holders
-- the walk gallops to the run's end (a few reads, however long the prompt). Blocks are read in
-- HMGET chunks of 8, 16, 32, 64, 64, ...
-- A live worker that leaves the confirmed holders (or never was one) while a predicted entry
-- or a sampled tail of a long prediction (_tails.lua) still carries it becomes a rider: riders
-- are walked one by one (confirmed, predicted or by a tail), and only they read predicted keys.
-- While no holder is left and every rider rides a tail, the walk skips ahead.
--#include _now.lua
--#include _tails.lua
--#include _key.lua
--#include _holders.lua
local pfx, chain = ARGV[1], ARGV[2]
local bkey = pfx .. 'B'
local nblocks = #chain / 16

local function field(j) return string.sub(chain, (j - 1) * 16 + 1, (j - 1) * 16 + KEY) end

-- does the worker of 2-byte code c hold v's block, at any tier?
local function holds(v, c)
  return held_as(v, c) ~= nil
end

-- block j's holders, read in growing chunks; reset() starts a new chunk at the next read
local vb, vbase, vlen, chunk = nil, 0, 0, 8
local function holders(j)
  if not vb or j <= vbase or j > vbase + vlen then
    local last = math.min(nblocks, j + chunk - 1)
    local fields = {}
    for jj = j, last do fields[#fields + 1] = field(jj) end
    vb, vbase, vlen = redis.call('HMGET', bkey, unpack(fields)), j - 1, last - j + 1
    chunk = math.min(chunk * 2, 64)
  end
  return vb[j - vbase]
end
local function reset()
  vb, chunk = nil, 8
end
local function probe(j)
  return redis.call('HGET', bkey, field(j))
end

-- the live workers with an unexpired predicted entry at block j: id -> true, read in growing
-- chunks (8, 16, 32, 64 keys): a walk that asks at a change of holders and then gallops needs one
local vq, qbase, qlen, qparsed, qchunk = nil, 0, 0, {}, 8
local function predicted_at(j)
  if not vq or j <= qbase or j > qbase + qlen then
    local last = math.min(nblocks, j + qchunk - 1)
    qchunk = math.min(qchunk * 2, 64)
    local qkeys = {}
    for jj = j, last do  -- predicted keys carry the whole digest
      qkeys[#qkeys + 1] = pfx .. 'q' .. string.sub(chain, (jj - 1) * 16 + 1, jj * 16)
    end
    vq, qbase, qlen, qparsed = redis.call('MGET', unpack(qkeys)), j - 1, last - j + 1, {}
  end
  local got = qparsed[j]
  if not got then
    got = {}
    local q = vq[j - qbase]
    if q then
      for k = 1, #q, 15 do
        local e = tonumber(string.sub(q, k + 2, k + 14))
        if e and e > now then got[string.sub(q, k, k + 1)] = true end
      end
    end
    qparsed[j] = got
  end
  return got
end

local tails, parsed = nil, {}  -- worker -> its tails, read on the first need
local function all_tails()
  if not tails then
    tails = {}
    if redis.call('EXISTS', KEYS[5]) == 1 then  -- usually not: no long prompt routed lately
      local all = redis.pcall('HGETALL', KEYS[5])
      if not all.err then
        for k = 1, #all - 1, 2 do tails[all[k]] = all[k + 1] end
      end
    end
  end
  return tails
end

-- the last block (from 1) of the chain that a tail of worker c carries it to from block j, or 0
local function reach(c, j)
  local v, best = all_tails()[c], 0
  if not v then return 0 end
  parsed[c] = parsed[c] or parse_tails(v)
  for _, t in ipairs(parsed[c]) do
    if t.e > now and t.from < j then
      for k = 0, t.n - 1 do
        local at = t.at + k * 20
        local p = struct.unpack('>I4', string.sub(v, at, at + 3))
        if p >= nblocks then break end
        if p >= j - 1 then
          if string.sub(chain, p * 16 + 1, p * 16 + 16) ~= string.sub(v, at + 4, at + 19) then
            break
          end
          if p + 1 > best then best = p + 1 end
        end
      end
    end
  end
  return best
end

-- candidates: the live workers holding block 1. Its confirmed holders come as they are, less
-- the few whose lease lapsed and whose entries the sweep (GC) has not removed yet: reading a
-- lease per holder cost more than the rest of a lookup whose first block a thousand workers
-- hold (a shared system prompt). Workers the sweep is removing, or ids no worker has, may
-- remain: the client keeps only the live workers it knows. Those holding block 1 only by a
-- predicted entry or a tail (few) have their leases read.
local v1, riding, ridelive = '', {}, {}  -- riding: those few, live, as a list and a set
if nblocks >= 1 then
  local v = holders(1) or ''
  local lapsed = {}
  for _, c in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)) do
    lapsed[c] = true
  end
  v1 = v
  if next(lapsed) then
    local keep = {}
    for k = 1, #v - 1, 2 do
      local c = string.sub(v, k, k + 1)
      if not lapsed[plain(c)] then keep[#keep + 1] = c end
    end
    v1 = table.concat(keep)
  end
  local more, ids = {}, {}
  for c in pairs(predicted_at(1)) do more[c] = true end
  for c in pairs(all_tails()) do more[c] = true end  -- workers with a sampled tail (few, if any)
  for c in pairs(more) do
    if #c == 2 and not holds(v, c) then ids[#ids + 1] = c end  -- anything else is junk
  end
  for s = 1, #ids, 256 do
    local part = {unpack(ids, s, math.min(#ids, s + 255))}
    local leases = redis.call('ZMSCORE', KEYS[1], unpack(part))
    for k, c in ipairs(part) do
      local lease = tonumber(leases[k])
      if lease and lease >= now then riding[#riding + 1], ridelive[c] = c, true end
    end
  end
end
local function islive(c) return ridelive[c] or holds(v1, c) end

local segs, riders, nr, dp, cover = {}, {}, 0, {}, {}
-- a live worker out of the confirmed holders at block j rides on if a prediction or tail does
local function board(c, j)
  if riders[c] then return end
  local r = 0
  if not predicted_at(j)[c] then
    r = reach(c, j)
    if r < j then return end
  end
  riders[c], nr, cover[c] = true, nr + 1, r
end

local walked, j = math.min(nblocks, 1), 1
local conf, prev, since = true, nil, 1  -- conf: the confirmed walk goes on
while (v1 ~= '' or #riding > 0) and j <= nblocks do
  local v = holders(j)
  walked = j
  if conf and (j == 1 or v ~= prev) then
    segs[#segs + 1] = j
    segs[#segs + 1] = v or ''
    -- who leaves the confirmed holders here may still ride: only predicted or tail holders can
    local maybe = {}
    for c in pairs(predicted_at(j)) do maybe[c] = true end
    for c in pairs(all_tails()) do maybe[c] = true end
    for c in pairs(maybe) do
      if islive(c) and (j == 1 or holds(prev, c)) and not holds(v, c) then board(c, j) end
    end
    conf, prev, since = v and true or false, v, j
  end
  for c in pairs(riders) do
    if cover[c] < j and not holds(v, c) and not predicted_at(j)[c] then
      local r = reach(c, j)
      if r >= j then
        cover[c] = r
      else
        riders[c], nr = nil, nr - 1
        if j > 1 then dp[c] = j - 1 end
      end
    end
  end
  if not conf and nr == 0 then break end
  local nxt = j + 1
  if not conf then  -- every rider rides a tail past here: skip to the nearest end
    local low = nblocks
    for c in pairs(riders) do low = math.min(low, cover[c]) end
    if low > j then
      nxt = low + 1
      walked = low
      reset()
    end
  elseif nr == 0 and j - since >= 8 and j < nblocks and j == vbase + vlen then
    -- a long run of the same holders and nobody riding: gallop to its end
    local lo, hi, step = j, nil, chunk
    while lo < nblocks do
      local p = math.min(nblocks, lo + step)
      if probe(p) ~= prev then
        hi = p
        break
      end
      lo, step = p, step * 2
    end
    while hi and hi - lo > 1 do
      local mid = math.floor((lo + hi) / 2)
      if probe(mid) == prev then lo = mid else hi = mid end
    end
    nxt, walked = lo + 1, lo
    reset()
  end
  j = nxt
end
for c in pairs(riders) do dp[c] = walked end
local recs = {}
for c, d in pairs(dp) do recs[#recs + 1] = c .. struct.pack('>I4', d) end
local lv = redis.call('GET', KEYS[4]) or '0'
local mine, all = tonumber(ARGV[3]), 0
local changed = {}
if not mine or not tonumber(lv) or mine > tonumber(lv) then  -- no version, or a reset store
  changed, all = redis.call('HGETALL', KEYS[2]), 1
elseif mine < tonumber(lv) then
  local ids = redis.call('ZRANGEBYSCORE', KEYS[6], '(' .. ARGV[3], '+inf')
  if #ids > 0 then
    local vals = redis.call('HMGET', KEYS[2], unpack(ids))
    for k, c in ipairs(ids) do
      changed[#changed + 1] = c
      changed[#changed + 1] = vals[k]
    end
  end
end
return cmsgpack.pack({redis.call('GET', KEYS[3]) or '0', v1 .. table.concat(riding), segs,
                      table.concat(recs), lv, changed, all, walked})
