"""Numbered SQL migrations of the plan store; applied in order by plancache.store."""
