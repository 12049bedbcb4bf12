-- Result codes: the numbers of router.index.ResultCode (a test checks that they agree).
local OK, STALE_EPOCH, RESYNC_NEEDED, UNKNOWN_WORKER, TAG_TAKEN, IDS_EXHAUSTED = 0, 1, 2, 3, 4, 5
