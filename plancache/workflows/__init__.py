"""Workflows on top of the cache: prewarming from manifests, warm start and priming,
checksummed bundles, inspection reports, graph templates and shape buckets."""
