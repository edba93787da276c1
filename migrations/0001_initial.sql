-- plancache store, schema 1.
-- One row per cached plan. Builds and autotuning run outside any transaction; only the
-- insert below runs inside one.
CREATE TABLE plans (
    key              TEXT PRIMARY KEY,          -- SHA-256 of graph + environment + options
    env_id           TEXT NOT NULL,             -- short hash of the environment part
    label            TEXT NOT NULL,             -- op summary, e.g. "CONV_FPROP+POINTWISE(bias)"
    graph_json       TEXT NOT NULL,             -- canonical description (key part)
    environment_json TEXT NOT NULL,             -- environment fingerprint (key part)
    options_json     TEXT NOT NULL,             -- build options (key part)
    tensors_json     TEXT NOT NULL,             -- [{uid, name, dims, strides, dtype, is_output}]
    blob             BLOB NOT NULL,             -- serialized execution plan
    blob_sha256      TEXT NOT NULL,             -- checked before every deserialize
    blob_size        INTEGER NOT NULL,
    engine_json      TEXT,                      -- chosen engine id, knobs, name: rebuilds without autotune
    workspace_size   INTEGER NOT NULL DEFAULT 0,
    policy           TEXT NOT NULL,             -- heuristic | topk | exhaustive
    candidates_json  TEXT NOT NULL,             -- every candidate's timing and status
    timing_json      TEXT NOT NULL,             -- how candidates were measured
    build_seconds    REAL NOT NULL,             -- wall time of the whole miss
    autotune_seconds REAL NOT NULL,             -- part of it spent timing candidates
    backend          TEXT NOT NULL,             -- which backend built it (cudnn, cpu-test)
    created_at       REAL NOT NULL,
    last_used_at     REAL NOT NULL,
    hit_count        INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX plans_env ON plans (env_id);
CREATE INDEX plans_last_used ON plans (last_used_at);

-- Entries that failed a check (checksum, deserialize, environment). Kept for inspection,
-- never served; `plancache prune --quarantined` empties it.
CREATE TABLE quarantine (
    id             INTEGER PRIMARY KEY AUTOINCREMENT,
    key            TEXT NOT NULL,
    reason         TEXT NOT NULL,
    quarantined_at REAL NOT NULL,
    row_json       TEXT NOT NULL,               -- the plans row without its blob
    blob           BLOB
);
CREATE INDEX quarantine_key ON quarantine (key);

-- One serialized kernel cache per environment, for dynamic-shape builds.
CREATE TABLE kernel_caches (
    env_id      TEXT PRIMARY KEY,
    blob        BLOB NOT NULL,
    blob_sha256 TEXT NOT NULL,
    revision    INTEGER,
    updated_at  REAL NOT NULL
);

-- Counters that survive processes: corrupt entries seen, rebuilds, remote refusals.
CREATE TABLE counters (
    name  TEXT PRIMARY KEY,
    value INTEGER NOT NULL DEFAULT 0
);
