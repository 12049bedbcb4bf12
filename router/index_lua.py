"""Lua scripts of the Redis prefix index: each index operation is one atomic EVALSHA.

Key layout under the model's hash tag ``P = "{tag}"`` (one Redis Cluster slot per model):

    P.."B"           hash: 16-byte digest -> the 2-byte big-endian ids of the workers holding
                     the block. One field per block is ~80 bytes of Redis memory (a key per
                     block would be ~105), many blocks are read in ONE HMGET (a lookup walks
                     512 blocks in ~10 Redis calls) and an apply writes a batch with one HMGET
                     + HSET (+ HDEL). A model lives in one cluster slot anyway (its hash tag).
    P.."q"..digest   predicted entries: records of 2-byte id + 13-digit expiry (ms, Redis
                     clock); the key's PX is the latest expiry
    P.."r:"..id      the worker's reverse index: its digests appended as 16-byte records.
                     Always a superset of its entries (removals leave garbage that is compacted
                     once it outweighs the live part), so GC of a dead worker is O(own blocks).
    P.."w:"..id      hash: rid, epoch, bs, fp, node, seq (-1 = needs resync), n, gc, gcpos
    P.."reg"         set of allocated ids;  P.."ids"  hash replica_id -> id
    P.."live"        zset 2-byte id -> lease expiry (ms, Redis clock)
    P.."load"        hash 2-byte id -> msgpack WorkerLoad;  P.."lv"  load version (bumped on
                     every change, so routers re-read loads only when one changed)
    P.."rv"          registry version (bumped when the id -> replica mapping changes)
    P.."name"        the model name owning the tag (detects tag collisions)

Per-block keys (P.."q"..digest) and P.."B" are built inside the scripts from the prefix; they all
share the declared keys' slot.
"""

_NOW = """
local _t = redis.call('TIME')
local now = tonumber(_t[1]) * 1000 + math.floor(tonumber(_t[2]) / 1000)
"""

# Block-set primitives over a blob of 16-byte digests, in chunks of at most 256 keys per call.
_BLOCKS = """
local CHUNK = 256

local function code_of(id)
  return struct.pack('>H', tonumber(id))
end

local function has(v, code)
  local p = string.find(v, code, 1, true)
  while p and p % 2 == 0 do p = string.find(v, code, p + 1, true) end
  return p ~= nil
end

local function without(v, code)
  local parts = {}
  for k = 1, #v, 2 do
    local c = string.sub(v, k, k + 1)
    if c ~= code then parts[#parts + 1] = c end
  end
  return table.concat(parts)
end

-- calls fn(digests, values) for each chunk of the blob; values from the block hash
local function each_chunk(bkey, blob, fn)
  local n = #blob / 16
  for s = 0, n - 1, CHUNK do
    local digests = {}
    for j = s, math.min(n, s + CHUNK) - 1 do
      digests[#digests + 1] = string.sub(blob, j * 16 + 1, j * 16 + 16)
    end
    fn(digests, redis.call('HMGET', bkey, unpack(digests)))
  end
end

-- adds the worker to every block of the blob; returns the digests it newly holds
local function add_blocks(bkey, code, blob)
  local added, seen = {}, {}
  each_chunk(bkey, blob, function(digests, vals)
    local kv = {}
    for j = 1, #digests do
      local d, v = digests[j], vals[j]
      if v and #v % 2 == 1 then v = nil end  -- junk, not 2-byte ids: overwrite it
      if not seen[d] and not (v and has(v, code)) then
        seen[d] = true
        kv[#kv + 1] = d
        kv[#kv + 1] = v and v .. code or code
        added[#added + 1] = d
      end
    end
    if #kv > 0 then redis.call('HSET', bkey, unpack(kv)) end
  end)
  return added
end

-- removes the worker from every block of the blob; returns how many entries it dropped
local function remove_blocks(bkey, code, blob)
  local removed, seen = 0, {}
  each_chunk(bkey, blob, function(digests, vals)
    local kv, dels = {}, {}
    for j = 1, #digests do
      local d, v = digests[j], vals[j]
      if v and #v % 2 == 1 and not seen[d] then  -- junk, not 2-byte ids: drop the field
        seen[d] = true
        dels[#dels + 1] = d
      elseif v and not seen[d] and has(v, code) then
        seen[d] = true
        removed = removed + 1
        if v == code then
          dels[#dels + 1] = d
        else
          kv[#kv + 1] = d
          kv[#kv + 1] = without(v, code)
        end
      end
    end
    if #kv > 0 then redis.call('HSET', bkey, unpack(kv)) end
    if #dels > 0 then redis.call('HDEL', bkey, unpack(dels)) end
  end)
  return removed
end

-- the digests of the blob the worker really holds, once each
local function held_blocks(bkey, code, blob)
  local keep, seen = {}, {}
  each_chunk(bkey, blob, function(digests, vals)
    for j = 1, #digests do
      local d, v = digests[j], vals[j]
      if v and not seen[d] and has(v, code) then
        seen[d] = true
        keep[#keep + 1] = d
      end
    end
  end)
  return keep
end
"""

# Returns 0 when the worker hash is usable for this epoch, -1 stale epoch, -2 not registered.
_EPOCH_OK = """
local function epoch_state(w, epoch)
  local st = redis.pcall('HMGET', w, 'epoch', 'gc')
  if st.err or not st[1] or st[2] then return -2 end
  local ep = tonumber(st[1])
  if not ep then return -2 end  -- junk epoch: register again
  if ep > epoch then return -1 end
  if ep < epoch then return -2 end
  return 0
end
"""

# KEYS: reg, ids, live, rv, name   ARGV: pfx, rid, epoch, bs, fp, node, ttl_ms, model
# -> {id, fresh} | {-1, registered_epoch} (stale) | {-2, 0} (tag owned by another model)
#    | {-3, 0} (65,535 ids in use)
REGISTER = _NOW + """
local pfx, rid, epoch = ARGV[1], ARGV[2], tonumber(ARGV[3])
local owner = redis.call('GET', KEYS[5])
if owner and owner ~= ARGV[8] then return {-2, 0} end
if not owner then redis.call('SET', KEYS[5], ARGV[8]) end
local expiry = now + tonumber(ARGV[7])
local id = redis.call('HGET', KEYS[2], rid)
local nid = tonumber(id)
if id and not (nid and nid == math.floor(nid) and nid >= 1 and nid <= 65535
               and redis.call('SISMEMBER', KEYS[1], id) == 1) then
  redis.log(redis.LOG_WARNING, 'prefix index: junk id for ' .. rid .. ' dropped')
  redis.call('HDEL', KEYS[2], rid)
  id = nil
end
if id then
  local w = pfx .. 'w:' .. id
  local old = redis.pcall('HGET', w, 'epoch')
  if type(old) == 'table' then  -- the record is not a hash: rebuild it
    redis.call('DEL', w)
    old = nil
  end
  old = tonumber(old)
  if old and old > epoch then return {-1, old} end
  if not old then  -- junk or missing record: rebuild it; the resync fixes its entries
    redis.log(redis.LOG_WARNING, 'prefix index: worker record ' .. w .. ' rebuilt')
    redis.call('HDEL', w, 'gc', 'gcpos')
    redis.call('HSET', w, 'rid', rid, 'n', math.floor(redis.call('STRLEN', pfx .. 'r:' .. id) / 16))
  end
  if not old or old < epoch then
    redis.call('HSET', w, 'epoch', ARGV[3], 'bs', ARGV[4], 'fp', ARGV[5], 'node', ARGV[6],
               'seq', -1)
    redis.call('INCR', KEYS[4])
  end
  redis.call('ZADD', KEYS[3], expiry, struct.pack('>H', tonumber(id)))
  return {tonumber(id), 0}
end
local i = 1
while redis.call('SISMEMBER', KEYS[1], i) == 1 do i = i + 1 end
if i > 65535 then return {-3, 0} end
redis.call('SADD', KEYS[1], i)
redis.call('HSET', KEYS[2], rid, i)
local w = pfx .. 'w:' .. i
redis.call('DEL', w, pfx .. 'r:' .. i)
redis.call('HSET', w, 'rid', rid, 'epoch', ARGV[3], 'bs', ARGV[4], 'fp', ARGV[5],
           'node', ARGV[6], 'seq', 0, 'n', 0)
redis.call('ZADD', KEYS[3], expiry, struct.pack('>H', i))
redis.call('INCR', KEYS[4])
return {i, 1}
"""

# KEYS: w, live, load, lv   ARGV: 2-byte id, epoch, ttl_ms, load_payload
# -> 1 ok | 0 re-register
HEARTBEAT = _NOW + """
local st = redis.pcall('HMGET', KEYS[1], 'epoch', 'gc')
if st.err or not st[1] or st[2] or tonumber(st[1]) ~= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[4])
redis.call('INCR', KEYS[4])
return 1
"""

# KEYS: w, r   ARGV: pfx, id, epoch, seq, ops
# ops: records of  op(1 byte: S stored, R removed, C cleared) | u32 BE count | count x 16 bytes
# -> 0 applied (or duplicate seq), 1 stale epoch, 2 resync needed
APPLY = _BLOCKS + """
local st = redis.pcall('HMGET', KEYS[1], 'epoch', 'seq', 'gc', 'n')
if st.err or not st[1] or st[3] or not tonumber(st[1]) then return 2 end
local ep, epoch = tonumber(st[1]), tonumber(ARGV[3])
if ep > epoch then return 1 end
if ep < epoch then return 2 end
local last, seq = tonumber(st[2]) or -1, tonumber(ARGV[4])
if last < 0 then return 2 end
if seq <= last then return 0 end
if seq ~= last + 1 then
  redis.call('HSET', KEYS[1], 'seq', -1)
  return 2
end
local bkey, code, ops, rkey = ARGV[1] .. 'B', code_of(ARGV[2]), ARGV[5], KEYS[2]
local n = tonumber(st[4]) or 0
local pos, len = 1, #ops
while pos <= len do
  local op = string.sub(ops, pos, pos)
  local cnt = struct.unpack('>I4', string.sub(ops, pos + 1, pos + 4))
  local blob = string.sub(ops, pos + 5, pos + 4 + cnt * 16)
  pos = pos + 5 + cnt * 16
  if op == 'S' then
    local added = add_blocks(bkey, code, blob)
    if #added > 0 then redis.call('APPEND', rkey, table.concat(added)) end
    n = n + #added
  elseif op == 'R' then
    n = n - remove_blocks(bkey, code, blob)
  elseif op == 'C' then
    remove_blocks(bkey, code, redis.call('GET', rkey) or '')
    redis.call('DEL', rkey)
    n = 0
  end
end
if redis.call('STRLEN', rkey) / 16 > 2 * n + 1024 then
  local keep = held_blocks(bkey, code, redis.call('GET', rkey))
  if #keep > 0 then redis.call('SET', rkey, table.concat(keep)) else redis.call('DEL', rkey) end
  n = #keep
end
redis.call('HSET', KEYS[1], 'seq', seq, 'n', n)
return 0
"""

# KEYS: w, r   ARGV: epoch   -> {code, old reverse blob}; marks the worker "needs resync"
RESYNC_BEGIN = _EPOCH_OK + """
local code = epoch_state(KEYS[1], tonumber(ARGV[1]))
if code ~= 0 then return {code, ''} end
redis.call('HSET', KEYS[1], 'seq', -1)
return {0, redis.call('GET', KEYS[2]) or ''}
"""

# KEYS: w, r   ARGV: pfx, id, epoch, removes, adds   -> code
RESYNC_CHUNK = _EPOCH_OK + _BLOCKS + """
local code = epoch_state(KEYS[1], tonumber(ARGV[3]))
if code ~= 0 then return code end
local bkey, wcode = ARGV[1] .. 'B', code_of(ARGV[2])
local n = tonumber(redis.call('HGET', KEYS[1], 'n')) or 0
n = n - remove_blocks(bkey, wcode, ARGV[4])
local added = add_blocks(bkey, wcode, ARGV[5])
if #added > 0 then redis.call('APPEND', KEYS[2], table.concat(added)) end
redis.call('HSET', KEYS[1], 'n', n + #added)
return 0
"""

# KEYS: w, r   ARGV: epoch, seq, blob   -> code
RESYNC_COMMIT = _EPOCH_OK + """
local code = epoch_state(KEYS[1], tonumber(ARGV[1]))
if code ~= 0 then return code end
if #ARGV[3] > 0 then redis.call('SET', KEYS[2], ARGV[3]) else redis.call('DEL', KEYS[2]) end
redis.call('HSET', KEYS[1], 'seq', ARGV[2], 'n', #ARGV[3] / 16)
return 0
"""

# KEYS: reg, live, ids, load, rv, lv   ARGV: pfx, only_id ('' = every expired lease)
# Marks dead workers (gc flag, out of live/ids/load) and returns their ids.
GC_MARK = _NOW + """
local pfx = ARGV[1]
local ids
if ARGV[2] ~= '' then
  ids = {}
  if redis.call('SISMEMBER', KEYS[1], ARGV[2]) == 1 then ids[1] = ARGV[2] end
else
  ids = redis.call('SMEMBERS', KEYS[1])
end
local out = {}
if ARGV[2] == '' then
  for _, c in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
    if #c ~= 2 or redis.call('SISMEMBER', KEYS[1], tostring(struct.unpack('>H', c))) == 0 then
      redis.call('ZREM', KEYS[2], c)
    end
  end
end
local valid = {}
for _, id in ipairs(ids) do
  local nid = tonumber(id)
  if nid and nid == math.floor(nid) and nid >= 1 and nid <= 65535 and tostring(nid) == id then
    valid[#valid + 1] = id
  else
    redis.log(redis.LOG_WARNING, 'prefix index: junk registry member dropped')
    redis.call('SREM', KEYS[1], id)
  end
end
for _, id in ipairs(valid) do
  local code = struct.pack('>H', tonumber(id))
  local dead = ARGV[2] ~= ''
  if not dead then
    local s = redis.call('ZSCORE', KEYS[2], code)
    dead = (not s) or tonumber(s) < now
  end
  if dead then
    local w = pfx .. 'w:' .. id
    local fresh = redis.pcall('HSETNX', w, 'gc', 1)
    if type(fresh) == 'table' then  -- the record is not a hash: replace it
      redis.call('DEL', w)
      fresh = redis.call('HSETNX', w, 'gc', 1)
    end
    if fresh == 1 then
      local rid = redis.call('HGET', w, 'rid')
      if rid and redis.call('HGET', KEYS[3], rid) == id then redis.call('HDEL', KEYS[3], rid) end
      redis.call('ZREM', KEYS[2], code)
      redis.call('HDEL', KEYS[4], code)
      redis.call('INCR', KEYS[5])
      redis.call('INCR', KEYS[6])
    end
    out[#out + 1] = id
  end
end
return out
"""

# KEYS: w, r, reg, rv   ARGV: pfx, id, max_blocks   -> {entries removed, done}
GC_CHUNK = _BLOCKS + """
local flagged = redis.pcall('HEXISTS', KEYS[1], 'gc')
if type(flagged) == 'table' or flagged == 0 then return {0, 1} end
local pfx, id, max = ARGV[1], ARGV[2], tonumber(ARGV[3])
local pos = tonumber(redis.call('HGET', KEYS[1], 'gcpos') or '0')
local chunk = redis.call('GETRANGE', KEYS[2], pos * 16, (pos + max) * 16 - 1)
local removed = remove_blocks(pfx .. 'B', code_of(id), chunk)
if #chunk < max * 16 then
  redis.call('DEL', KEYS[1], KEYS[2])
  redis.call('SREM', KEYS[3], id)
  redis.call('INCR', KEYS[4])
  return {removed, 1}
end
redis.call('HSET', KEYS[1], 'gcpos', pos + max)
return {removed, 0}
"""

# KEYS: live, load, rv, lv   ARGV: pfx, chain (16-byte digests), the caller's load version
# -> {rv, live 2-byte ids, per worker that matched anything: 2-byte id | u32 confirmed |
#     u32 predicted, lv, loads of the live workers in order (nil when lv is the caller's),
#     blocks walked}
# Walks block by block and stops at the first block no live worker matched (confirmed or
# predicted). Blocks are read in HMGET chunks of 8, 16, 32, 64, 64, ... so it reads at most one
# chunk past that block; predicted keys are read only where a worker still walking has no
# confirmed entry (typically one chunk at the end of the walk).
LOOKUP = _NOW + """
local pfx, chain = ARGV[1], ARGV[2]
local bkey = pfx .. 'B'
local live = {}
for _, c in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')) do
  if #c == 2 then live[#live + 1] = c end  -- anything else is junk, not a worker
end
local nblocks = #chain / 16
local dc, dp, ac, au = {}, {}, {}, {}
local nu = #live
for _, c in ipairs(live) do
  ac[c] = true
  au[c] = true
end
local mark, pmark = {}, {}
local walked, i, chunk = 0, 0, 8
local prev, clean = nil, false  -- last block's value; clean: every walker was confirmed there
while nu > 0 and i < nblocks do
  local last = math.min(nblocks, i + chunk)
  local fields = {}
  for j = i + 1, last do
    fields[#fields + 1] = string.sub(chain, (j - 1) * 16 + 1, j * 16)
  end
  local vb = redis.call('HMGET', bkey, unpack(fields))
  local vq, qbase = nil, 0
  for j = i + 1, last do
    walked = j
    local v = vb[j - i]
    -- Fast path: the same holders as the last block, where every walker was confirmed, so
    -- every walker goes on. A worker's depth is only written when it drops out.
    if not (clean and v == prev) then
      if v then
        for k = 1, #v, 2 do mark[string.sub(v, k, k + 1)] = j end
      end
      -- predicted entries matter only for a walker without a confirmed entry here
      local need = false
      for c in pairs(au) do
        if mark[c] ~= j then
          need = true
          break
        end
      end
      if need then
        if not vq then
          local qkeys = {}
          for jj = j, last do qkeys[#qkeys + 1] = pfx .. 'q' .. fields[jj - i] end
          vq, qbase = redis.call('MGET', unpack(qkeys)), j - 1
        end
        local q = vq[j - qbase]
        if q then
          for k = 1, #q, 15 do
            local e = tonumber(string.sub(q, k + 2, k + 14))
            if e and e > now then
              pmark[string.sub(q, k, k + 1)] = j
            end
          end
        end
      end
      for c in pairs(au) do
        if mark[c] ~= j and pmark[c] ~= j then
          au[c] = nil
          nu = nu - 1
          if j > 1 then dp[c] = j - 1 end
        end
      end
      for c in pairs(ac) do
        if mark[c] ~= j then
          ac[c] = nil
          if j > 1 then dc[c] = j - 1 end
        end
      end
      prev, clean = v, not need
    end
    if nu == 0 then break end
  end
  i = last
  chunk = math.min(chunk * 2, 64)
end
for c in pairs(au) do dp[c] = walked end
for c in pairs(ac) do dc[c] = walked end
local recs = {}
for c, d in pairs(dp) do recs[#recs + 1] = c .. struct.pack('>I4I4', dc[c] or 0, d) end
local lv = redis.call('GET', KEYS[4]) or '0'
local loads = false
if lv ~= ARGV[3] and #live > 0 then loads = redis.call('HMGET', KEYS[2], unpack(live)) end
return {redis.call('GET', KEYS[3]) or '0', table.concat(live), table.concat(recs), lv, loads,
        walked}
"""

# KEYS: live   ARGV: pfx, id, ttl_ms, chain   -> number of blocks written
PREDICT = _NOW + """
local pfx, code, chain = ARGV[1], struct.pack('>H', tonumber(ARGV[2])), ARGV[4]
local exp = now + tonumber(ARGV[3])
local mine = code .. string.format('%013d', exp)
local n = #chain / 16
for s = 0, n - 1, 64 do
  local keys = {}
  for j = s, math.min(n, s + 64) - 1 do
    keys[#keys + 1] = pfx .. 'q' .. string.sub(chain, j * 16 + 1, j * 16 + 16)
  end
  local vals = redis.call('MGET', unpack(keys))
  for j = 1, #keys do
    local parts, maxe, v = {mine}, exp, vals[j]
    if v then
      for k = 1, #v, 15 do
        local e = tonumber(string.sub(v, k + 2, k + 14))
        if e and string.sub(v, k, k + 1) ~= code and e > now then
          parts[#parts + 1] = string.sub(v, k, k + 14)
          if e > maxe then maxe = e end
        end
      end
    end
    redis.call('SET', keys[j], table.concat(parts), 'PX', maxe - now)
  end
end
return n
"""

# KEYS: live, rv   ARGV: pfx   -> {rv, {id, {rid, epoch, bs, fp, node}, ...}}
LIVE = _NOW + """
local out = {}
for _, c in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')) do
  if #c == 2 then  -- anything else is junk, not a worker
    local id = struct.unpack('>H', c)
    local rec = redis.pcall('HMGET', ARGV[1] .. 'w:' .. id, 'rid', 'epoch', 'bs', 'fp', 'node')
    if rec.err then rec = {false, false, false, false, false} end
    out[#out + 1] = id
    out[#out + 1] = rec
  end
end
return {redis.call('GET', KEYS[2]) or '0', out}
"""
