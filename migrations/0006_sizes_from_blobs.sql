-- plancache store, schema 6: the size total counts each blob's own length, never the
-- blob_size column beside it. That column is a number the database can compute, so a row
-- whose blob_size was altered could make eviction remove too little or too much; the
-- total is recomputed from the blobs, and the triggers that keep it exact read them.
DROP TRIGGER plans_size_insert;
DROP TRIGGER plans_size_delete;
DROP TRIGGER plans_size_update;
UPDATE totals SET value = (SELECT coalesce(sum(length(blob)), 0) FROM plans) WHERE name = 'plan_bytes';
CREATE TRIGGER plans_size_insert AFTER INSERT ON plans BEGIN
    UPDATE totals SET value = value + length(NEW.blob) WHERE name = 'plan_bytes';
END;
CREATE TRIGGER plans_size_delete AFTER DELETE ON plans BEGIN
    UPDATE totals SET value = value - length(OLD.blob) WHERE name = 'plan_bytes';
END;
CREATE TRIGGER plans_size_update AFTER UPDATE OF blob ON plans BEGIN
    UPDATE totals SET value = value - length(OLD.blob) + length(NEW.blob) WHERE name = 'plan_bytes';
END;
