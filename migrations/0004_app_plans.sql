-- plancache store, schema 4: which plans each application used in its latest runs, so that
-- the next start of the application loads exactly those in the background, while it still
-- imports and loads its weights (auto-prime). One row per application, key and device; a
-- run that uses the key again takes the row over.
CREATE TABLE app_plans (
    app         TEXT    NOT NULL,  -- PLANCACHE_APP, else the entry script (and local rank)
    key         TEXT    NOT NULL,
    device      INTEGER NOT NULL,  -- the device index the run used the plan on
    run         TEXT    NOT NULL,  -- the process run that used it last
    run_started REAL    NOT NULL,  -- when that run opened the cache: the latest run is primed
    seq         INTEGER NOT NULL,  -- order of first use in that run: primed in this order
    PRIMARY KEY (app, key, device)
);
CREATE INDEX app_plans_latest ON app_plans (app, run_started);
