"""Which candidate plan to keep: launched on the same inputs through the driver
(``candidates``, one code path for every backend), checked element by element against the
others (``bounds``, ``consensus``), and timed within the miss's budget (``autotune``). No
cuDNN import here; torch only inside the calls that make tensors."""
