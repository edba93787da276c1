"""The byte formats plancache reads and writes without any library of cuDNN's: UBJSON, in
which cuDNN Frontend serializes a plan, a plan blob decoded once (``plan_blob``) and the
graph it carries (``plan_graph``). Pure Python, below every other layer but the
errors and the configuration, so the store can judge a blob as the engines load it."""
