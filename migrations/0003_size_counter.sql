-- plancache store, schema 3: the database tracks the total size of its plans itself, so
-- the eviction that a write makes necessary runs inside that write's transaction and reads
-- one row instead of summing the table (two processes evicting at once no longer both
-- measure the same excess). Quarantined rows live in their own table: they never count.
CREATE TABLE totals (
    name  TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
INSERT INTO totals (name, value) SELECT 'plan_bytes', coalesce(sum(blob_size), 0) FROM plans;
CREATE TRIGGER plans_size_insert AFTER INSERT ON plans BEGIN
    UPDATE totals SET value = value + NEW.blob_size WHERE name = 'plan_bytes';
END;
CREATE TRIGGER plans_size_delete AFTER DELETE ON plans BEGIN
    UPDATE totals SET value = value - OLD.blob_size WHERE name = 'plan_bytes';
END;
CREATE TRIGGER plans_size_update AFTER UPDATE OF blob_size ON plans BEGIN
    UPDATE totals SET value = value - OLD.blob_size + NEW.blob_size WHERE name = 'plan_bytes';
END;
