-- KEYS: log, its counter   -> {the newest entry's id ('' when the log is empty), the number of
--   the newest entry ever logged (0: none)}: read together, so that a follower starting here
--   knows the number the next entry must carry, even when the log is empty or was trimmed empty
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local n = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
if #last == 0 then return {'', n} end
return {last[1][1], n}
