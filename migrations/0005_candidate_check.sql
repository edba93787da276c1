-- plancache store, schema 5: how the stored choice was checked. Every candidate that
-- autotuning launches runs on the same inputs and is compared with the others; the record
-- says whether the chosen plan agreed with a majority (and which engines were rejected, with
-- the error measured), or why nothing was launched. Rows written before schema 5 keep NULL:
-- they were never checked, so a lookup does not serve them but autotunes (and checks) the
-- graph again and replaces them.
ALTER TABLE plans ADD COLUMN check_json TEXT;
