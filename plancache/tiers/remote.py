"""The fleet tier: one shared Redis behind every node's local SQLite store.

One machine autotunes a plan and publishes it; every other machine with the same
environment fetches it instead of autotuning. Entries travel in the portable form of
``codec.encode_entry``, signed with HMAC-SHA256 under a secret every node shares, because
a plan blob can carry native code: an entry that is unsigned, signed with another secret,
altered, undecodable or stored under the wrong key is refused, counted and never returned.

Every argument of ``RemoteTier`` but ``backoff_max`` is read by its setting
(``PLANCACHE_REDIS_*`` in plancache.config), so a bad value is a ``ConfigError`` naming the
argument. Construction touches no network, and nothing raises after it: ``get`` returns a
verified entry (its usage fields this node's) or None on a miss, a refusal or an outage;
``put`` returns False on an outage, a full Redis, a blob that fails its checksum or a value
over ``max_value``. ``lock`` is cross-node single flight: True means build now (this node
holds the lock, or Redis cannot coordinate); False means the entry appeared or the wait ran
out, so call ``get`` again. Publish with ``put`` inside the with-block, so that waiters find
the entry. A lock key with no expiry, or one beyond ``lock_ttl``, is taken over (one
warning).

Bounded delay
-------------
Every call (through ``breaker.Breaker``) is one attempt, with no client-side retries, held
to one deadline for the whole call (``bounded``; a healthy Redis that lost a script reloads
it well within it): ``timeout`` per round trip (connect + command, + AUTH with a password,
+ SELECT with a database other than 0, + CLIENT SETNAME with a client name), so 0.5 s with
the defaults and no password. After a failure the tier is skipped for 1, 2, 4 ...
``backoff_max`` seconds (one warning per outage, an info line when Redis answers again);
once failed calls have cost ``max_stall`` it is off for the rest of the process. So an
unreachable, black-holed or hung Redis delays a process by at most ``max_stall`` plus one
attempt (2.5 s with the defaults and no password) in all, however many lookups it makes.
``lock(wait=W)`` returns within W plus one attempt (its waits on a healthy Redis are the
caller's choice, not counted). Releasing a lock is the one call made while backing off
(counted, so the bound holds); renewals and release retries run on the lock's own thread.
Hostnames are resolved by the OS resolver, which these timeouts do not bound: give an IP
address or a name in /etc/hosts on nodes whose DNS may hang.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import inspect
import math
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from ..config import (
    REDIS_LOCK_TTL,
    REDIS_MAX_STALL,
    REDIS_MAX_VALUE,
    REDIS_NAMESPACE,
    REDIS_SECRET,
    REDIS_SECRET_FILE,
    REDIS_TIMEOUT,
    REDIS_TTL,
    REDIS_URL,
    ConfigError,
    Refused,
    Setting,
)
from ..errors import RemoteError
from ..store import Entry, problem
from ..store.codec import decode_entry, encode_entry
from ..store.files import read_secret_file
from .bounded import bounded_connection
from .breaker import FAILED, Breaker, Call, RemoteCount
from .fleet_lock import FleetLock

if TYPE_CHECKING:
    import redis

__all__ = ["FORMAT", "SIGNATURE_MAGIC", "RemoteTier", "configured_secret", "secret_id", "settings_from_env", "sign_value"]

FORMAT = 2  # in every key: a new value layout gets new keys instead of refusals (2: the tag covers the key)
SIGNATURE_MAGIC = b"PLANCACHE-SIGNED/1\n"
_KEY_ID_SIZE = 8
_TAG_SIZE = 32  # HMAC-SHA256
_HEADER_SIZE = len(SIGNATURE_MAGIC) + _KEY_ID_SIZE + _TAG_SIZE
#: What an operation may read besides one value: the framing of its reply and the replies
#: of a connection's handshake, each a few dozen bytes.
_REPLY_SLACK = 64 << 10

# The value only if Redis counts it within the cap (ARGV[1] bytes), else its length as an
# integer: one round trip, atomic, and a value over the cap never leaves Redis.
_GET_LUA = """
local size = redis.call('STRLEN', KEYS[1])
if size > tonumber(ARGV[1]) then return size end
return redis.call('GET', KEYS[1])
"""
T = TypeVar("T")


class _Refused(ValueError):
    """A value that must not be used; ``kind`` picks the warning, the text explains."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


# ---------------------------------------------------------------------------- signing


def secret_id(secret: bytes) -> bytes:
    """A fingerprint of the secret, stored in each value (and in each signed bundle) so that a
    node with another secret says so instead of reporting tampering. It is an HMAC output: it
    reveals nothing."""
    return hmac.new(secret, b"plancache-remote-key-id", hashlib.sha256).digest()[:_KEY_ID_SIZE]


def _tag(secret: bytes, name: str, encoded: bytes) -> bytes:
    # The magic is MACed too, so a tag made for another purpose or layout never verifies; and
    # the Redis key the value is stored under (namespace, format, environment, plan key), so
    # a value copied under another name (another namespace sharing the secret) never does.
    where = name.encode("utf-8")
    return hmac.new(secret, SIGNATURE_MAGIC + len(where).to_bytes(4, "big") + where + encoded, hashlib.sha256).digest()


def sign_value(encoded: bytes, secret: bytes, name: str) -> bytes:
    """The Redis value of an encoded entry stored under ``name``: magic, key id,
    HMAC-SHA256 tag (over ``name`` and the entry), entry."""
    return SIGNATURE_MAGIC + secret_id(secret) + _tag(secret, name, encoded) + encoded


def _verified_payload(value: bytes, secret: bytes, key_id: bytes, name: str) -> bytes:
    """The encoded entry inside a value signed for ``name``; raises ``_Refused`` saying why not."""
    if not value.startswith(SIGNATURE_MAGIC) or len(value) < _HEADER_SIZE:
        raise _Refused("unsigned", "value is not signed (no plancache signature header)")
    offset = len(SIGNATURE_MAGIC)
    their_id = value[offset : offset + _KEY_ID_SIZE]
    tag = value[offset + _KEY_ID_SIZE : _HEADER_SIZE]
    payload = value[_HEADER_SIZE:]
    if not hmac.compare_digest(their_id, key_id):
        raise _Refused("other-secret", f"signed with another secret (key id {their_id.hex()}, this node's {key_id.hex()}); "
                       f"check that every node has the same {REDIS_SECRET.name} or {REDIS_SECRET_FILE.name}")  # fmt: skip
    if not hmac.compare_digest(tag, _tag(secret, name, payload)):
        raise _Refused("bad-signature", "signature does not match: the value was altered, or signed for another name "
                       "(another namespace)")  # fmt: skip
    return payload


# ---------------------------------------------------------------------------- configuration


def settings_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The arguments of the tier that ``PLANCACHE_REDIS_*`` configure, each read by its
    setting's declaration, or None when no URL is set. Touches no network and imports no
    redis, so a command checks them before it creates anything."""
    env = os.environ if environ is None else environ
    url = REDIS_URL.from_env(env)
    if url is None:
        return None
    return {"url": url, "secret": _secret_from_env(env), "namespace": REDIS_NAMESPACE.from_env(env),
            "timeout": REDIS_TIMEOUT.from_env(env), "ttl": REDIS_TTL.from_env(env), "lock_ttl": REDIS_LOCK_TTL.from_env(env),
            "max_stall": REDIS_MAX_STALL.from_env(env), "max_value": REDIS_MAX_VALUE.from_env(env)}  # fmt: skip


def configured_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The fleet's secret (``PLANCACHE_REDIS_SECRET`` or the file ``PLANCACHE_REDIS_SECRET_FILE``
    names, one of them), or None when neither is set: it signs Redis entries and bundles."""
    env = os.environ if environ is None else environ
    if REDIS_SECRET.is_set(env) and REDIS_SECRET_FILE.is_set(env):
        raise ConfigError(f"{REDIS_SECRET.name} and {REDIS_SECRET_FILE.name} are both set: set one of them",
                          name=REDIS_SECRET.name, value=None)  # fmt: skip
    path = REDIS_SECRET_FILE.from_env(env)
    if path is None:
        return REDIS_SECRET.from_env(env)
    try:  # the setting reads the path; the file is read as every file a user names is
        return read_secret_file(path)
    except Refused as exc:
        text = env[REDIS_SECRET_FILE.name]
        raise ConfigError(f"{REDIS_SECRET_FILE.name}={text!r} {exc}", name=REDIS_SECRET_FILE.name, value=text) from None


def _secret_from_env(env: Mapping[str, str]) -> bytes:
    secret = configured_secret(env)
    if secret is None:
        raise ConfigError(f"{REDIS_URL.name} is set but no secret is: set {REDIS_SECRET_FILE.name} or {REDIS_SECRET.name} "
                          "(the same on every node); plan blobs can carry native code, so plancache uses no unsigned "
                          "Redis tier", name=REDIS_SECRET.name, value=None)  # fmt: skip
    return secret


def _required(setting: Setting[T | None], value: object, argument: str) -> T:
    """``value`` read by ``setting``: an argument RemoteTier cannot do without."""
    found = setting.of(value, argument)
    if found is None:
        raise ConfigError(f"{argument} is missing: a Redis tier needs one ({setting.name} in the environment)",
                          name=setting.name, value=None)  # fmt: skip
    return found


def _redact(url: str) -> str:
    """The URL with its password replaced, for logs and stats: the one before the host
    (``redis://:pw@host``) and the one in the query (``unix:///sock?password=pw``), both of
    which redis-py reads."""
    parts = urlsplit(url)
    if parts.password is not None:
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
        url = urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
    head, mark, query = url.partition("?")
    if mark:  # by hand: urlunsplit would write unix:///sock as unix:/sock
        fields = ["password=***" if field.split("=", 1)[0].lower() == "password" else field for field in query.split("&")]
        url = f"{head}?{'&'.join(fields)}"
    return url


def _round_trips(connection: Mapping[str, Any]) -> int:
    """Round trips of a call on a new connection: connect, the command, and each handshake
    command these connection options make redis-py send (``AbstractConnection.on_connect``)."""
    handshake = [connection.get("password") or connection.get("username") or connection.get("credential_provider"),
                 connection.get("client_name"), connection.get("db")]  # fmt: skip
    return 2 + sum(1 for step in handshake if step)


def _quiet_handshake() -> dict[str, Any]:
    """Connection options that skip CLIENT SETINFO: two round trips fewer per connect, each
    of which a hung Redis could stretch to a full timeout."""
    import redis.connection

    params = inspect.signature(redis.connection.AbstractConnection.__init__).parameters
    if "driver_info" in params:  # redis-py >= 7 (lib_name would warn there)
        return {"driver_info": None}
    return {"lib_name": None, "lib_version": None}


# ---------------------------------------------------------------------------- the tier


class RemoteTier:
    """A signed, namespaced view of one Redis, shared by every node of a fleet. Thread-safe
    and fork-safe (redis-py reconnects in a child); the module docstring gives the interface
    and the bound on the delay an outage can cause."""

    def __init__(
        self,
        url: str,
        *,
        secret: bytes,
        namespace: str = REDIS_NAMESPACE.default,
        timeout: float = REDIS_TIMEOUT.default,
        ttl: int | None = REDIS_TTL.default,
        lock_ttl: float = REDIS_LOCK_TTL.default,
        backoff_max: float = 60,
        max_stall: float = REDIS_MAX_STALL.default,
        max_value: int = REDIS_MAX_VALUE.default,
    ) -> None:
        url = _required(REDIS_URL, url, "url")
        self._secret = _required(REDIS_SECRET, secret, "secret")
        self._key_id = secret_id(self._secret)
        if not (math.isfinite(backoff_max) and backoff_max > 0):
            raise ConfigError(f"backoff_max={backoff_max!r} is not a number of seconds above 0", name="backoff_max",
                              value=backoff_max)  # fmt: skip
        self.url = _redact(url)
        self._url = url
        self.namespace = REDIS_NAMESPACE.of(namespace, "namespace")
        self.timeout = REDIS_TIMEOUT.of(timeout, "timeout")
        self.ttl = REDIS_TTL.of(ttl, "ttl")
        self.lock_ttl = REDIS_LOCK_TTL.of(lock_ttl, "lock_ttl")
        self.backoff_max = float(backoff_max)
        self.max_stall = REDIS_MAX_STALL.of(max_stall, "max_stall")
        self.max_value = REDIS_MAX_VALUE.of(max_value, "max_value")
        try:
            import redis  # optional dependency: only nodes that use the tier need it
        except ImportError as exc:
            raise RemoteError("the Redis tier needs redis-py: pip install 'plancache[redis]'") from exc
        self._redis: Any = redis
        self._client = self._connect(url)
        self.deadline = self.timeout * _round_trips(self._client.connection_pool.connection_kwargs)
        self._breaker = Breaker(self._redis, self.url, backoff_max=self.backoff_max, max_stall=self.max_stall,
                                deadline=self.deadline, max_reply=self.max_value + _REPLY_SLACK)  # fmt: skip
        self._get = self._client.register_script(_GET_LUA)
        self._locks = FleetLock(self._client, self._breaker.script_call, lock_ttl=self.lock_ttl, count=self._breaker.count,
                                warn_once=self._breaker.warn_once)  # fmt: skip

    def _connect(self, url: str) -> redis.Redis:
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        module = self._redis
        ours = {
            "socket_timeout": self.timeout,
            "socket_connect_timeout": self.timeout,
            "retry": Retry(NoBackoff(), 0),  # one attempt per call: the backoff is ours
            "health_check_interval": 0,
            "decode_responses": False,  # signed blobs are bytes, never text
            "protocol": 2,  # redis-py 8 speaks RESP3 by default: a HELLO round trip more per connect
        }
        try:
            pool = module.ConnectionPool.from_url(url, **ours, **_quiet_handshake())
        except ValueError as exc:  # what redis-py refuses beyond the scheme (a port that is no number, say)
            raise ConfigError(f"{REDIS_URL.name} (or url=) {_redact(url)} is not a Redis URL: {exc}", name=REDIS_URL.name,
                              value=None) from exc  # fmt: skip
        # Options in the URL's query (?decode_responses=true, ?socket_timeout=30) override
        # keyword arguments in redis-py; these are what keep every call bounded and every
        # value bytes, so they are set again.
        pool.connection_kwargs.update(ours)
        pool.connection_class = bounded_connection(pool.connection_class)
        client: redis.Redis = module.Redis(connection_pool=pool)
        return client

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RemoteTier | None:
        """The tier configured by ``PLANCACHE_REDIS_*`` (``settings_from_env``), or None
        when no URL is set."""
        settings = settings_from_env(environ)
        return None if settings is None else cls(**settings)

    def arguments(self) -> dict[str, Any]:
        """The arguments that build this tier again, secret included: for a process of the
        caller's own that needs the same tier (a prewarm worker), never for a log."""
        return {"url": self._url, "secret": self._secret, "namespace": self.namespace, "timeout": self.timeout,
                "ttl": self.ttl, "lock_ttl": self.lock_ttl, "backoff_max": self.backoff_max, "max_stall": self.max_stall,
                "max_value": self.max_value}  # fmt: skip

    # ------------------------------------------------------------------ public

    @property
    def key_id(self) -> str:
        return self._key_id.hex()

    @property
    def available(self) -> bool:
        """Whether the next call would reach out to Redis (not backing off, not switched off)."""
        return self._breaker.available

    def redis_key(self, key: str, env_id: str) -> str:
        return f"{self.namespace}:v{FORMAT}:{env_id}:{key}"

    def get(self, key: str, env_id: str) -> Entry | None:
        """The verified entry for ``key``, or None (miss, refusal or outage)."""
        name = self.redis_key(key, env_id)
        value = self._breaker.call(Call.GET, lambda: self._get(keys=[name], args=[self.max_value]))
        if value is FAILED:
            return None
        if value is None:
            self._breaker.count(RemoteCount.REMOTE_MISSES)
            return None
        if not isinstance(value, (bytes, int)):  # RESP2 gives neither a list nor text here, but a hostile server may
            self._refuse(name, "malformed", f"the reply is a {type(value).__name__}, not a value")
            return None
        if isinstance(value, int):
            self._refuse(name, "too-large", f"its value is {value} bytes, more than {REDIS_MAX_VALUE.name} ({self.max_value}); "
                         "it was not read")  # fmt: skip
            return None
        entry = self._open(name, value, key, env_id)
        if entry is not None:
            self._breaker.count(RemoteCount.REMOTE_HITS)
        return entry

    def put(self, entry: Entry) -> bool:
        """Publish ``entry`` signed; True once Redis has stored it."""
        reason = problem(entry)
        if reason is not None:  # every node that fetched it would refuse it: it would cost Redis memory and them a refusal
            return self._unpublished("put-checksum", "plancache: not publishing %s: %s", entry.key[:12], reason)
        # Usage counts are per node; a receiver starts from zero.
        neutral = dataclasses.replace(entry, hit_count=0, last_used_at=0.0)
        name = self.redis_key(entry.key, entry.env_id)
        value = sign_value(encode_entry(neutral), self._secret, name)
        if len(value) > self.max_value:  # every node would refuse it unread
            return self._unpublished("put-too-large", "plancache: not publishing %s: its value is %d bytes, more than %s (%d)",
                                     entry.key[:12], len(value), REDIS_MAX_VALUE.name, self.max_value)  # fmt: skip
        stored = self._breaker.call(Call.PUT, lambda: self._client.set(name, value, ex=self.ttl))
        if stored is FAILED or not stored:
            return False
        self._breaker.count(RemoteCount.PUBLISHES)
        return True

    def lock(self, key: str, env_id: str, wait: float) -> contextlib.AbstractContextManager[bool]:
        """Cross-node single flight for one key (the module docstring gives the contract).
        Renewed while the with-block runs, it expires ``lock_ttl`` seconds after the last
        renewal: a node that dies while building makes the others wait at most
        ``min(wait, lock_ttl)``."""
        return self._locks.hold(self.redis_key(key, env_id), wait)

    def stats(self) -> dict[str, Any]:
        counters: dict[str, Any] = self._breaker.counters()
        counters.update(available=self.available, url=self.url, namespace=self.namespace, key_id=self.key_id)
        return counters

    def close(self) -> None:
        self._locks.close()  # first: its last release attempt needs the client
        self._client.close()
        self._client.connection_pool.disconnect()

    def __repr__(self) -> str:
        return f"RemoteTier({self.url!r}, namespace={self.namespace!r})"

    # ------------------------------------------------------------------ internals

    def _open(self, name: str, value: bytes, key: str, env_id: str) -> Entry | None:
        """Verify, then decode; anything doubtful is refused and counted, never raised."""
        try:
            entry = decode_entry(_verified_payload(value, self._secret, self._key_id, name))
            if entry.key != key or entry.env_id != env_id:
                raise _Refused("wrong-key", f"holds entry {entry.key[:12]}/{entry.env_id}, not the one asked for")
        except _Refused as exc:
            self._refuse(name, exc.kind, str(exc))
            return None
        except ValueError as exc:  # signed by us yet undecodable: a bug or a newer plancache
            self._refuse(name, "undecodable", str(exc))
            return None
        return dataclasses.replace(entry, hit_count=0, last_used_at=time.time())

    def _refuse(self, name: str, kind: str, detail: str) -> None:
        self._breaker.count(RemoteCount.REFUSED)
        self._breaker.warn_once(f"refused-{kind}", "plancache: refused Redis entry %s: %s; building locally instead (see `refused` "
                                "in stats)", name, detail)  # fmt: skip

    def _unpublished(self, topic: str, message: str, *args: Any) -> bool:
        """An entry not published, counted and told once: False."""
        self._breaker.count(RemoteCount.ERRORS)
        self._breaker.warn_once(topic, message, *args)
        return False
