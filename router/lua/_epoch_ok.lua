-- OK when the worker hash is usable for this epoch, else STALE_EPOCH or UNKNOWN_WORKER.
--#include _codes.lua
local function epoch_state(w, epoch)
  local st = redis.pcall('HMGET', w, 'epoch', 'gc')
  if st.err or not st[1] or st[2] then return UNKNOWN_WORKER end
  local ep = tonumber(st[1])
  if not ep then return UNKNOWN_WORKER end  -- junk epoch: register again
  if ep > epoch then return STALE_EPOCH end
  if ep < epoch then return UNKNOWN_WORKER end
  return OK
end
