-- state.db as written by schema 1 (PRAGMA user_version=1): a finished job, two users.
PRAGMA user_version=1;
BEGIN TRANSACTION;
CREATE TABLE events (
    job_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    type TEXT NOT NULL,
    time REAL NOT NULL,
    data_json TEXT NOT NULL,
    PRIMARY KEY (job_id, seq)
) WITHOUT ROWID;
INSERT INTO "events" VALUES('j-29191f',1,'submitted',1.79606507734573292729e+09,'{"user": "root", "name": "made-by-schema-1", "gpus": 1, "ranks": 1, "sla": "standard", "kind": "source"}');
INSERT INTO "events" VALUES('j-29191f',2,'scheduled',1.79606507735010409356e+09,'{"attempt": 1, "reason": "placed on node-1 [0], 1 of 1 devices: standard job, next in queue; free devices", "placement": [{"node": "node-1", "devices": [0], "ranks": [0]}]}');
INSERT INTO "events" VALUES('j-29191f',3,'started',1.79606507735904335977e+09,'{"ranks": [0], "pids": {"0": 2375}, "devices": [0], "attempt": 1, "node": "node-1"}');
INSERT INTO "events" VALUES('j-29191f',4,'interruptible',1.79606507762206459044e+09,'{"rank": 0, "interruptible": false, "safe_points": [], "loops": 0, "boundaries": 1, "not_safe_points": [], "message": "no loops: safe points only between top-level statements"}');
INSERT INTO "events" VALUES('j-29191f',5,'log',1.79606507762785577771e+09,'{"rank": 0, "stream": "stdout", "line": "kept across upgrades\n"}');
INSERT INTO "events" VALUES('j-29191f',6,'result',1.79606507771910905838e+09,'{"repr": "42", "bytes": 5, "error": null}');
INSERT INTO "events" VALUES('j-29191f',7,'worker_exited',1.79606507771916937832e+09,'{"rank": 0, "code": 0, "node": "node-1"}');
INSERT INTO "events" VALUES('j-29191f',8,'succeeded',1.79606507772043180468e+09,'{"seconds": 0.361}');
CREATE TABLE jobs (
    id TEXT PRIMARY KEY,
    user TEXT NOT NULL,
    name TEXT NOT NULL,
    state TEXT NOT NULL,
    sla TEXT NOT NULL,
    gpus INTEGER NOT NULL,
    ranks INTEGER NOT NULL,
    source TEXT,
    callable_b64 TEXT,
    inputs_b64 TEXT,
    outputs_json TEXT NOT NULL DEFAULT '[]',
    outputs_pickle BLOB,
    outputs_skipped_json TEXT,
    filename TEXT NOT NULL,
    env_json TEXT NOT NULL DEFAULT '{}',
    args_json TEXT NOT NULL DEFAULT '[]',  -- sys.argv[1:] of every rank
    workdir TEXT,                  -- the folder it was submitted from: its working directory
    workdir_b64 TEXT,              -- a copy of that folder, for nodes that do not see it
    checkpoint_every REAL,
    placement_json TEXT NOT NULL DEFAULT '[]',
    attempt INTEGER NOT NULL DEFAULT 0,
    retries INTEGER NOT NULL DEFAULT 0,
    exited_json TEXT NOT NULL DEFAULT '{}',
    stop_reason TEXT,              -- cancel | failed | preempt, while workers are being stopped
    stop_detail_json TEXT,         -- who asked and why (for the event that closes the stop)
    last_checkpoint_json TEXT,     -- newest complete checkpoint reported by the workers
    moved_at REAL,                 -- last preemption/migration/resize (anti-thrash)
    migration_json TEXT,           -- from, to, when of the migration in progress
    not_before REAL,               -- a retry waits out its backoff until then
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    started_at REAL,
    ended_at REAL,
    error TEXT,
    result_pickle BLOB,
    result_repr TEXT,
    result_error TEXT,
    last_seq INTEGER NOT NULL DEFAULT 0,
    held_s REAL NOT NULL DEFAULT 0,      -- seconds it held devices, over finished stretches
    attained_s REAL NOT NULL DEFAULT 0,  -- device-seconds of those stretches (attained service)
    held_since REAL                      -- start of the current stretch on devices, if any
);
INSERT INTO "jobs" VALUES('j-29191f','root','made-by-schema-1','succeeded','standard',1,1,'print(''kept across upgrades'')
6 * 7',NULL,NULL,'[]',NULL,'{}','<cell>','{}','[]','/work/main',NULL,NULL,'[{"node": "node-1", "devices": [0], "ranks": [0]}]',1,0,'{"0": 0}',NULL,NULL,NULL,NULL,NULL,NULL,1.79606507734573292729e+09,1796065077.72035,1.79606507735904335977e+09,1.79606507772034788136e+09,NULL,X'80054B2A2E','42',NULL,8,3.70541810989379882812e-01,3.70541810989379882812e-01,NULL);
CREATE TABLE nodes (
    name TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    devices_json TEXT NOT NULL,
    instance TEXT NOT NULL,
    acked_seq INTEGER NOT NULL DEFAULT 0,
    heartbeat_at REAL,
    address TEXT                     -- how other nodes reach it (rank 0's MASTER_ADDR)
);
INSERT INTO "nodes" VALUES('node-1','ready','[{"index": 0, "kind": "cpu", "name": "cpu-slot-0", "uuid": null, "memory_bytes": null}]','dd4df8478ac14f5c92b6a181b68ec7d0',5,1.7960650777204635143e+09,'127.0.0.1');
CREATE TABLE quotas (
    user TEXT NOT NULL,
    tier TEXT NOT NULL,
    devices INTEGER NOT NULL,       -- most devices the user's jobs of this tier hold at this tier
    PRIMARY KEY (user, tier)
) WITHOUT ROWID;
CREATE TABLE users (
    name TEXT PRIMARY KEY,
    token TEXT UNIQUE NOT NULL,    -- sha256 of the token (credentials.hash_token), never the token
    role TEXT NOT NULL,            -- admin | user | join | node
    created_at REAL NOT NULL
);
INSERT INTO "users" VALUES('root','sha256:c11774326db8a18d7d57e078afb49da3b3c5ab290a10d5b4bac06050cba06ab3','admin',1.79606507654673743252e+09);
INSERT INTO "users" VALUES('agents','sha256:8ee30e476aa31a7f7fa372902eb06d113b5b092e875ecbae524d7dab4ad7a123','join',1.79606507654682064057e+09);
INSERT INTO "users" VALUES('node:node-1','sha256:7187b303ef3b9ee693c820ddfbb8bc7ca19b538ab71029c6f6d29d148e37fadc','node',1796065076.5577);
INSERT INTO "users" VALUES('alice','sha256:4e611bd7bc95d4893d3bacf03c39f9cd0d63649d6b71ae6bc7a38f4997174fd2','user',1.79606507782995915411e+09);
CREATE INDEX jobs_user ON jobs(user, created_at);
CREATE INDEX jobs_state ON jobs(state);
COMMIT;
