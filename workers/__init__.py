"""The worker side: a paged-KV, prefix-caching GQA engine and its Ray Serve replica."""
