-- plancache store, schema 2: a checksum over what a plan executes with besides its blob
-- (tensor table, engine, workspace size), so a flipped bit there is caught like one in the
-- blob. Rows written by schema 1 keep NULL: they are still checked by re-hashing their key
-- and comparing their input tensors with the graph.
ALTER TABLE plans ADD COLUMN meta_sha256 TEXT;
