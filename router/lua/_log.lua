-- The model's event log P.."E": a stream that routers follow to keep their own copy of the
-- confirmed holders and the predicted entries (router.index_follower), so a decision needs no
-- round trip. Kept while routers ask for it: P.."Ecap" holds the cap the last one to start set
-- (absent: no log). Each entry is n (numbered from 1 without a gap: a follower sees what the cap
-- trimmed away), w (the worker id), k (the kind: O a batch's op stream, Z a resync's whole set of
-- KEY-byte keys, D the worker is dead, P a predicted entry: u32 ttl ms | 16-byte digests) and d
-- (the data).
local function log_event(pfx, id, kind, data)
  local cap = tonumber(redis.call('GET', pfx .. 'Ecap'))
  if not cap or cap <= 0 then return end
  local n = redis.call('INCR', pfx .. 'En')
  redis.call('XADD', pfx .. 'E', 'MAXLEN', '~', cap, '*', 'n', n, 'w', id, 'k', kind, 'd', data)
end
