"""prefixserve's own compiled kernels for CPUs, and their build (`build`): what torch's ops do
not do at the rate the hardware allows."""
