-- plancache store, schema 8: the judgement of each stored plan, kept. A process that judged
-- a plan sound and read its load's record (both pure functions of the blob, the row's
-- graph and tensor table, and plancache's code) writes them here, in the background with
-- its hit counts; a later lookup of the same row, under the same code, reads them instead
-- of decoding and judging the blob again. Bound to the row's blob and metadata checksums
-- and checksummed itself; a row written again (`put`) starts without one.
ALTER TABLE plans ADD COLUMN judgement TEXT;
