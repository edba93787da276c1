-- plancache store, schema 7: the graphs whose plans a process built and did not store, and
-- why (the plan could not be loaded back from its blob, or the judge refused the plan the
-- frontend had just built for the graph: a defect of plancache). Kept so that `plancache
-- stats` shows the graphs that cannot be persisted across processes; a later store of the
-- key removes its row.
CREATE TABLE unstored (
    key        TEXT    PRIMARY KEY,
    label      TEXT    NOT NULL,  -- the graph's op summary
    why        TEXT    NOT NULL,  -- unloadable | judge_disagreements
    reason     TEXT    NOT NULL,  -- the latest reason, in words
    times      INTEGER NOT NULL,  -- how many builds were not stored
    first_at   REAL    NOT NULL,
    last_at    REAL    NOT NULL
);
