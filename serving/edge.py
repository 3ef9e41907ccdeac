"""Edge admission: an HAProxy in front of the router that decides, in C, what to admit and what to shed.

Why HAProxy: past capacity the router's event loop is the saturated resource, so a 503 decided in
Python waits behind the queue it protects. Why a standing-queue rule, not a concurrency cap: a
closed-loop client (one that waits for each answer) cannot send faster than it is answered, so 8,
32 or 128 of them are a queue the server drains at full throughput, never an overload. Overload is
requests arriving faster than they are answered, and its signature is a queue that stands and grows.

The rule, two queue lengths: at most `max_in_flight` requests (K) are inside the router at once,
enough for full batches; the rest wait in HAProxy's queue, first come first served.
- While the edge has shed nothing in the last second, up to `max_burst` (B) may wait: clients that
  wait for their answers (K + B of them are never refused) and short bursts.
- A request that finds B waiting is the sign of overload (requests arriving faster than they are
  answered): it gets 503 + Retry-After at once, and so does every request, for as long as the edge
  keeps shedding (a 1 s sliding rate), that finds more than `max_queue` (Q) waiting, or more
  requests inside (in the router and waiting) than the router answered in the last `delay_ms` (D)
  at the rate it has been answering them, but never fewer than Q. So what is admitted while
  shedding waits about the shorter of (K + Q) / capacity and D: the counts alone let the wait grow
  as each query costs more, D caps it. The rate is HAProxy's own (`be_sess_rate`: requests sent to
  the router in the last second, which while shedding is the rate it answers).
- Closed-loop clients cannot start the shedding: N <= K + B of them never find B waiting. Their
  queue and an overload's look alike by length (both stand); what differs is that an overload
  overflows, and only then does the edge tighten. `timeout queue` is the backstop when capacity
  drops (a swap, a dead replica).
- Fair shares among collections: while more than one collection (or the served index) sends, a
  request of one holding no more than (K + B) / the collections of the requests inside (or only
  this one) is dequeued first and is not cut with an overload's queue (OWNER_EXPIRE_S): a quiet
  collection beside a flooded one is answered while the flood is shed.
- `/v1/health` is outside the rule, on a backend of its own (HEALTH_IN_FLIGHT in the router at
  most): a load balancer's check is never queued behind searches nor shed with them.
`shardserve tune` writes K, B and Q from a sweep's knee (K + Q = capacity x delay target).
Why two lengths, not one (B = Q): one long enough for the clients that wait lets what an overload
admits wait as long; one short enough for the overload refuses waiting clients. `python -m
loadtests.shedding --index DIR --access-log --serve-flags '--edge-queue 64'` against the same
without the flag compares them (docs/experiments.md).

`shardserve serve` runs one in front of its Serve by default (EdgeProcess); `shardserve edge-config`
writes the config for clusters, where `haproxy -f` runs it (Debian package `haproxy`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from shardserve.errors import BadArgument, ShardserveError
from shardserve.runtime import procfs

OVERLOADED_BODY = '{"error": "overloaded: edge queue full", "field": null}\n'


# Defaults of `shardserve serve` when no tuned values are given: K covers the largest batches the
# router forms at 32 clients with room to spare; B admits 128 waiting clients; Q keeps an overload's
# admitted wait near that of 80 waiting clients (`make bench-admission` checks them; docs/performance.md).
DEFAULT_IN_FLIGHT = 64
DEFAULT_BURST = 64
DEFAULT_QUEUE = 16
DEFAULT_QUEUE_TIMEOUT_MS = 1000
# While shedding, what is inside is cut to the router's last second of answers x D: twice the delay
# target `shardserve tune` sizes K + Q with (deployments.tune.DELAY_TARGET_S; a test keeps them so).
# At the default nprobe the router answers fast enough that K + Q binds first; a costlier query,
# whose answers come slower, gets D where the counts alone let its wait grow. A shorter D would cut a
# costly query's batches too small, and goodput with them (docs/experiments.md).
DEFAULT_DELAY_MS = 70
# While it sheds nothing, the edge lets wait at least B and at most what the router answers in this
# long at its last second's rate (D_B): a stall of the router or its node (a scheduler hiccup on a
# busy node, a collection) shorter than this is absorbed, not shed. B alone is a count: near
# capacity, K + B requests are only tens of milliseconds of arrivals, so a stall a little longer
# sheds requests of a load the server keeps up with (docs/experiments.md). The price is an overload's
# onset: until the first shed, what is admitted may wait up to ~D_B longer; once shedding, Q and D cut it.
DEFAULT_BURST_MS = 250
# Where a batch's queries share each shard's scan (IVF-Flat lists larger than a core's cache,
# shardserve.query.scan_choice.shares_scan), a larger batch costs less a query: K holds the batch 128
# waiting clients make, and D is off, since cutting what is inside below a batch that shares the
# scan makes each query dearer, the rate falls, and the cut tightens again (docs/experiments.md
# compares these defaults with K 64, D 70 ms). What is admitted while shedding waits about
# (K + Q) / capacity and a batch. The edge takes these from the index served when it starts (a swap
# to an index on the other side of the cache threshold keeps them: restart, or set the flags).
SHARED_SCAN_IN_FLIGHT = 128
SHARED_SCAN_DELAY_MS = 0
HEALTH_IN_FLIGHT = 4  # health checks inside the router at once, beside the K searches
# The text lane (requests that carry text: a search, an embed or an upsert by text). A text the
# cache misses costs a model run, many times a vector search, so text requests have slots of their
# own: K_t inside the router, at most Q_t more waiting at the edge (one more gets a 503 at once).
# A flood of texts then fills its own lane and queue, never the K slots vector searches use, and
# K_t + Q_t closed-loop text clients (128, as K + B for vectors) are never refused.
DEFAULT_TEXT_IN_FLIGHT = 32
DEFAULT_TEXT_QUEUE = 96
DEFAULT_TEXT_QUEUE_SHEDDING = 8
TEXT_QUEUE_TIMEOUT_MS = 10_000  # the text lane's backstop (capacity dropped), as embed_timeout_s
# A body asking by text: a field named "text" or "texts" (in a search, an embed or an upsert by
# text) within the body's first tune.bufsize bytes. A vector body matches too if it names a
# metadata column so (it then takes the text lane, and its limits); a text request that does not
# match (an escaped key, a key past the buffer) is refused by the router with a 422 (the lane
# header the edge sets on every request says which lane it came by).
TEXT_BODY = """'"texts?"[[:space:]]*:'"""  # single-quoted for HAProxy: its quotes are literal

# Fair shares among collections. A request's owner is the collection its path names (the segment
# after `/collections/`, native or Chroma's, read from the path percent-decoded with its repeated
# slashes joined, as the router reads it), or `/` for the served index's own routes. While more than
# one owner is known (a request in the last OWNER_EXPIRE_S, or one still at the edge or the
# router), a request whose owner has no more requests at the edge and in the router than (K + B) /
# the owners, or only this one, is within its share: it is dequeued before the others (HAProxy's
# priority class) and is not cut by the rules that cut an overload's queue, only past that
# overflow + B waiting. A collection searched at a steady rate beside a flooded one is then
# answered, where one queue for every collection shed it as it shed the flood
# (loadtests/records/collections-isolation.json). Why requests in flight, not a rate: a request's
# cost is in how long it stays, so a costly flood counts as it weighs, and the shares add up to
# K + B, the edge's own bound for clients that wait, whatever the router answers a second or how
# cheap its other answers are. A client that invents collection names divides the shares finer for
# every collection (a fairness rule among trusted clients; the API key is the boundary), and what
# goes first is still cut past the overflow + B. One owner alone is admitted exactly as without it.
OWNER_EXPIRE_S = 2
OWNER_TABLE_SIZE = 10_000  # owners remembered at once (the oldest are dropped): bounded memory
OWNER_KEY_BYTES = 128  # an owner's name as compared (longer ones are cut)
_OWNER_TABLE = (f"stick-table type string len {OWNER_KEY_BYTES} size {OWNER_TABLE_SIZE} "
                f"expire {OWNER_EXPIRE_S}s")

# Health checks one client address may send per second: a load balancer checks a few times a second
# at most, so past this a source is flooding, and gets 429 at the edge; the checks of every other
# source (the load balancer's) still reach the router's HEALTH_IN_FLIGHT slots.
HEALTH_RATE_PER_SOURCE = 20
# After refusing a body it will not read (413, or 401 to a large upload), the edge reads and drops
# up to this much of it, for at most DRAIN_S, before closing: a client that writes its whole body
# before reading (Python's urllib) then reads the answer instead of a broken pipe. nginx's
# lingering close does the same.
DRAIN_BYTES = 64 * 1024 * 1024
DRAIN_S = 5
_KEY_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~+/=")


@dataclass(frozen=True, kw_only=True)
class Admission:
    """What the edge admits. Arguments:
    max_in_flight: requests inside the router at once (K).
    max_burst: requests that may wait at the edge while it sheds nothing (B); the next one is shed
        and starts the shedding.
    max_queue: requests that may wait at the edge while it is shedding (Q, at most B): a new one
        that finds more gets 503 at once.
    queue_timeout_ms: the longest an admitted request waits in the queue before a 503 (backstop).
    delay_ms: while shedding, more requests inside (router + queue) than the router's answer rate x
        this (but at least max_queue) get 503 too (D); 0: the counts alone.
    burst_ms: while not shedding, up to the router's answer rate x this may wait (D_B), when that
        is more than max_burst; 0: max_burst alone.
    text_in_flight: requests carrying text inside the router at once (K_t), in a lane of their own
        (see DEFAULT_TEXT_IN_FLIGHT).
    text_queue: text requests that may wait at the edge (Q_t); the next one gets 503 at once.
    text_queue_shedding: while the text lane has shed in the last second, text requests that may
        wait (Q_t if fewer): an overload's admitted texts wait less.
    """

    max_in_flight: int = DEFAULT_IN_FLIGHT
    max_burst: int = DEFAULT_BURST
    max_queue: int = DEFAULT_QUEUE
    queue_timeout_ms: int = DEFAULT_QUEUE_TIMEOUT_MS
    delay_ms: int = DEFAULT_DELAY_MS
    burst_ms: int = DEFAULT_BURST_MS
    text_in_flight: int = DEFAULT_TEXT_IN_FLIGHT
    text_queue: int = DEFAULT_TEXT_QUEUE
    text_queue_shedding: int = DEFAULT_TEXT_QUEUE_SHEDDING

    def __post_init__(self) -> None:
        if min(self.max_in_flight, self.queue_timeout_ms, self.text_in_flight) < 1 or min(
                self.max_queue, self.delay_ms, self.burst_ms, self.text_queue) < 0:
            raise BadArgument("max_in_flight, text_in_flight and queue_timeout_ms must be >= 1, max_queue, "
                              "text_queue, delay_ms and burst_ms >= 0")
        if self.text_queue_shedding < 0:
            raise BadArgument(f"text_queue_shedding must be >= 0, got {self.text_queue_shedding}")
        if self.max_burst < self.max_queue:
            raise BadArgument(f"max_burst ({self.max_burst}) must be >= max_queue ({self.max_queue})")


def default_admission(shared_scan: bool) -> Admission:
    """`shardserve serve`'s admission when none is given: the defaults above, or, where a batch's
    queries share each shard's scan (`shared_scan`), K and D for batches that share it."""
    if shared_scan:
        return Admission(max_in_flight=SHARED_SCAN_IN_FLIGHT, delay_ms=SHARED_SCAN_DELAY_MS)
    return Admission()


def check_api_key(key: str) -> str:
    """The key as HAProxy will compare it: 16-256 printable token characters, nothing to escape."""
    if not 16 <= len(key) <= 256 or not set(key) <= _KEY_CHARS:
        raise ShardserveError("API key: 16-256 characters of A-Z a-z 0-9 - . _ ~ + / =")
    return key


def api_key_digest(key: str) -> str:
    """What the edge's config holds instead of the key: its SHA-256, in hex. The edge compares the
    digest of what a request carries, so neither the config nor the comparison holds the key."""
    return hashlib.sha256(check_api_key(key).encode()).hexdigest()


def edge_config(backend: str, listen: str = "127.0.0.1:8080", admission: Admission | None = None,
                errorfile: str | Path = "edge-503.http", api_key: str | None = None,
                threads: int = 1, max_body_bytes: int = 16 * 1024 * 1024, access_log: bool = False,
                lua_file: str | Path = "edge-refuse.lua", route_prefix: str = "/",
                health_rate: int = HEALTH_RATE_PER_SOURCE) -> str:
    """HAProxy config text: `listen` -> `backend` (the router's HTTP door), with the two-length
    queue admission of the module docstring and, when `api_key` is set, a 401 for any request but
    the health check that does not carry it (`Authorization: Bearer KEY`, the scheme in any case,
    or `api-key: KEY`); the key is compared by its digest and never forwarded.
    `lua_file`: refuse_lua()'s service (answers a body it will not read, then drains it).
    `route_prefix`: where the app is routed; the health check is exactly `<prefix>v1/health`.
    `access_log`: one line per request on HAProxy's stdout, in its standard HTTP log format
    (`parse_access_line` reads its timers)."""
    a = admission or Admission()
    shed_when = "!health !text !light overflow || !health !text !light standing shedding" + (
        " || !health !text !light shedding crowded late" if a.delay_ms else "") + " || light light_full" + (
        " light_over" if a.burst_ms else "")
    text_shed_when = "!health text text_full || !health text text_shedding text_standing"
    health_path = route_prefix.rstrip("/") + "/v1/health"
    log_global, log_defaults = "", ""
    if access_log:  # a write per request on the edge's thread: off by default (it costs goodput)
        log_global = "    log stdout format raw local0\n"
        log_defaults = "    log global\n    option httplog\n"
    key_rules = ""
    if api_key is not None:
        key_rules = f"""    # `api-key: KEY` or `Authorization: Bearer KEY` (any case), compared by SHA-256
    http-request set-var(txn.key) req.hdr(api-key) if {{ req.hdr(api-key) -m found }}
    http-request set-var(txn.key) http_auth_bearer unless {{ var(txn.key) -m found }}
    acl keyed var(txn.key),sha2(256),hex,lower -m str {api_key_digest(api_key)}
    acl read method GET HEAD
    http-request set-var(txn.unkeyed) bool(1) if !keyed !health || !keyed !read
    acl unkeyed var(txn.unkeyed) -m bool
    # a body the edge would not have read before answering: refused by the draining service
    http-request use-service lua.shardserve_refuse if unkeyed unread || unkeyed chunked
    {_returns(401, _UNAUTHORIZED, "WWW-Authenticate Bearer")} if unkeyed
    # the router never sees the key
    http-request del-header api-key
    http-request del-header authorization
"""
    errors = "".join(f'    http-error status {code} content-type application/json string "{_json(text)}"\n'
                     for code, text in sorted(EDGE_ERRORS.items()))
    return f"""# Generated by `shardserve edge-config`: admission decided in HAProxy, not in Python.
global
{log_global}    maxconn 4096
    nbthread {threads}
    tune.bufsize 65536
    # a second edge on the same port fails to start instead of sharing its connections
    noreuseport
    lua-load {lua_file}
defaults
{log_defaults}    mode http
    timeout connect 1s
    timeout client 30s
    timeout server 30s
    # a whole request (head and, once waited for below, its body) must arrive within this
    timeout http-request 10s
    timeout http-keep-alive 30s
    # backstop: an admitted request still queued after this gets 503 (capacity dropped)
    timeout queue {a.queue_timeout_ms}ms
    option http-keep-alive
    # what the edge answers itself is in the API's JSON error shape, never HAProxy's HTML page
{errors}frontend shardserve_edge
    bind {listen}
    acl health path {health_path}
    acl unread req.hdr_val(content-length) gt {UNREAD_BYTES}
    acl chunked req.hdr(transfer-encoding) -m found
    # a declared body over the limit: 413 at once from its length, before a byte of it is read
    http-request use-service lua.shardserve_refuse if {{ req.hdr_val(content-length) gt {max_body_bytes} }}
    # health checks have their own rate limit per source: a flood of them (no key needed) cannot
    # crowd out the load balancer's checks
    http-request track-sc1 src table health_meter if health
    {_returns(429, _HEALTH_FLOOD, "Retry-After 1")} if health {{ sc_http_req_rate(1) gt {health_rate} }}
{key_rules}    # the router sees a request only once its body is here: a trickled upload holds no router slot
    http-request wait-for-body time 10s
    # Text requests take a lane of their own: {a.text_in_flight} inside the router, {a.text_queue} waiting,
    # the next one refused at once; the vector lane's rules below never see them.
    acl text req.body -m reg {TEXT_BODY}
    # which lane it took, for the router (a text request in the vector lane is refused there)
    http-request del-header x-shardserve-lane
    http-request set-header x-shardserve-lane text if text
    http-request set-header x-shardserve-lane vector if !text
    # A text that finds {a.text_queue} waiting is past capacity: 503, and while the text lane has
    # shed in the last second, {a.text_queue_shedding} waiting is its standing queue: shed that too,
    # so what is admitted under a text overload waits ~(K_t + {a.text_queue_shedding}) / texts answered
    # a second.
    acl text_full queue(shardserve_text) ge {a.text_queue}
    acl text_shedding int(0),table_gpc0_rate(text_shed_meter) gt 0
    acl text_standing queue(shardserve_text) ge {min(a.text_queue_shedding, a.text_queue)}
    http-request set-var(txn.text_shed) bool(1) if {text_shed_when}
    http-request track-sc0 int(0) table text_shed_meter if {{ var(txn.text_shed) -m bool }}
    http-request sc-inc-gpc0(0) if {{ var(txn.text_shed) -m bool }}
    {_returns(503, _OVERLOADED, "Retry-After 1")} if {{ var(txn.text_shed) -m bool }}
{_owner_rules(a)}    # Admission, in C: more than {a.max_burst} waiting{_burst_words(a)} is an overflow, past
    # capacity; while the edge has shed in the last second, more than {a.max_queue} waiting is a
    # standing queue: shed it.
{_overflow_rules(a)}    acl standing queue(shardserve) gt {a.max_queue}
    acl shedding int(0),table_gpc0_rate(shed_meter) gt 0
{_late_rules(a)}    http-request set-var(txn.shed) bool(1) if {shed_when}
    http-request track-sc0 int(0) table shed_meter if {{ var(txn.shed) -m bool }}
    http-request sc-inc-gpc0(0) if {{ var(txn.shed) -m bool }}
    {_returns(503, _OVERLOADED, "Retry-After 1")} if {{ var(txn.shed) -m bool }}
{_answer_rules(a)}    # a load balancer's health check is never queued behind searches nor shed with them: an
    # overloaded node that a health check saw as down would push its load onto the others
    use_backend shardserve_health if health
    use_backend shardserve_text if text
    default_backend shardserve
backend shed_meter
    # one counter: the requests the edge shed, as a rate over the last second
    stick-table type integer size 1 expire 10s store gpc0_rate(1s)
backend text_shed_meter
    # the same for the text lane
    stick-table type integer size 1 expire 10s store gpc0_rate(1s)
{_answer_meter(a)}backend owner_meter
    # one entry per owner (a collection, or `/`): its requests at the edge and in the router are
    # the streams tracking it (sc_trackers); an owner with none for {OWNER_EXPIRE_S} s is forgotten
    {_OWNER_TABLE}
backend health_meter
    # health checks per client address over the last second
    stick-table type ipv6 size 100k expire 10s store http_req_rate(1s)
backend shardserve_health
    http-reuse always
    errorfile 503 {errorfile}
    server router {backend} maxconn {HEALTH_IN_FLIGHT}
backend shardserve_text
    http-reuse always
    errorfile 503 {errorfile}
    # a full text queue is a fast 503 above; an admitted text waits about (K_t + Q_t) / the texts
    # answered a second (seconds, where a text costs a model run): the backstop waits longer
    timeout queue {TEXT_QUEUE_TIMEOUT_MS}ms
    server router {backend} maxconn {a.text_in_flight}
backend shardserve
    http-reuse always
    errorfile 503 {errorfile}
    # (the door ends each kept-alive connection after 1,000 requests, announced with `Connection:
    # close`: router replicas share its port, and a new connection may reach one started since)
    server router {backend} maxconn {a.max_in_flight}
"""


def refuse_lua(max_body_bytes: int = 16 * 1024 * 1024) -> str:
    """The edge's Lua service for a request whose body it will not read: answers at once (413 when
    the declared length is over `max_body_bytes`, else 401), then reads and drops up to DRAIN_BYTES
    of the body for at most DRAIN_S, and closes. Closing with the body unread would reset the
    connection, and a client still writing it would see a broken pipe, never the answer."""
    unauthorized = json.dumps({"error": EDGE_ERRORS[401], "field": None})
    return f"""-- Generated by `shardserve edge-config` (serving/edge.py refuse_lua).
core.register_service("shardserve_refuse", "http", function(applet)
    local declared = applet.headers["content-length"]
    local length = declared and tonumber(declared[0])
    local status, body = 401, [[{unauthorized}]]
    if length ~= nil and length > {max_body_bytes} then
        status = 413
        body = '{{"error": "body of ' .. declared[0] .. ' bytes exceeds {max_body_bytes}", "field": "body"}}'
    end
    applet:set_status(status)
    applet:add_header("content-type", "application/json")
    applet:add_header("content-length", tostring(#body))
    applet:add_header("connection", "close")
    if status == 401 then
        applet:add_header("www-authenticate", "Bearer")
    end
    applet:start_response()
    applet:send(body)
    local left, started = {DRAIN_BYTES}, core.now().sec
    while left > 0 and core.now().sec - started < {DRAIN_S} do
        local chunk = applet:receive(math.min(left, 16384))
        if chunk == nil or #chunk == 0 then
            break
        end
        left = left - #chunk
    end
end)
"""


def _burst_words(a: Admission) -> str:
    return f", and more than the router answers in {a.burst_ms} ms," if a.burst_ms else ""


def _overflow_rules(a: Admission) -> str:
    """`overflow`: more than B waiting and, with D_B, more than the router's answers over the last
    second x D_B (`answer_meter`; read only past B: no lookup for a request below it)."""
    if not a.burst_ms:
        return f"    acl overflow queue(shardserve) gt {a.max_burst}\n"
    room = f"int(0),table_gpc0_rate(answer_meter),mul({a.burst_ms}),div(1000)"
    return f"""    acl past_burst queue(shardserve) gt {a.max_burst}
    http-request set-var(txn.queued) queue(shardserve) if past_burst
    http-request set-var(txn.burst_room) {room} if past_burst
    acl overflow var(txn.queued),sub(txn.burst_room) -m int gt 0
"""


def _owner_rules(a: Admission) -> str:
    """`light`: a request whose owner holds no more than (K + B) / the owners of the requests at
    the edge and in the router, or only this one, while more than one owner is known
    (OWNER_EXPIRE_S); it is dequeued first (priority class -1) and shed only when `light_full`
    (and `light_over` with D_B): more than the vector lane's overflow + B waiting (an ACL cannot
    name another: the shed rule joins them)."""
    full = f"    acl light_full queue(shardserve) gt {2 * a.max_burst}\n"
    owned, several = "!health !text in_collection", "!health !text several"
    if a.burst_ms:  # past the overflow (B, or the router's answers in D_B) by B more
        full += f"    acl light_over var(txn.queued),sub(txn.burst_room) -m int gt {a.max_burst}\n"
    return f"""    # Fair shares: an owner (the collection the path names, `/` for the served index) holding
    # no more than (K + B) / the owners of the requests inside goes first, not cut with an overload
    http-request set-var(txn.route) path,url_dec,regsub(/+,/,g) if !health !text
    acl in_collection var(txn.route) -m reg /collections/[^/]
    http-request set-var(txn.owner) var(txn.route),regsub(^.*/collections/,/),field(2,/) if {owned}
    http-request set-var(txn.owner) str(/) if !health !text !in_collection
    http-request track-sc1 var(txn.owner) table owner_meter if !health !text
    acl several table_cnt(owner_meter) gt 1
    http-request set-var(txn.owners) table_cnt(owner_meter) if !health !text several
    http-request set-var(txn.share) int({a.max_in_flight + a.max_burst}),div(txn.owners) if {several}
    acl within sc_trackers(1),sub(txn.share) -m int le 0
    acl alone sc_trackers(1) le 1
    http-request set-var(txn.light) bool(1) if !health !text several within || !health !text several alone
    acl light var(txn.light) -m bool
    http-request set-priority-class int(-1) if light
{full}"""


def _answer_rules(a: Admission) -> str:
    """Count the router's answers (D_B's rate): the admitted searches are tracked, and their
    responses counted. Not the admitted arrivals (be_sess_rate): at an overload's onset those
    run at the overload's rate, and D_B of them would be a wait of D_B x the overload."""
    if not a.burst_ms:
        return ""
    return """    http-request track-sc2 int(0) table answer_meter if !health !text
    http-response sc-inc-gpc0(2) if { sc2_tracked }
"""


def _answer_meter(a: Admission) -> str:
    if not a.burst_ms:
        return ""
    return """backend answer_meter
    # one counter: the router's answers to admitted searches, as a rate over the last second
    stick-table type integer size 1 expire 10s store gpc0_rate(1s)
"""


def _late_rules(a: Admission) -> str:
    """While shedding: `crowded`, more than Q inside (router + queue); `late`, more inside than the
    router answered in the last D ms at the last second's rate. Computed only while shedding, and
    the shed meter is read only when the router holds at least min(K, Q): fewer in the router means
    no queue (HAProxy queues only at K) and so at most Q inside, never crowded."""
    if not a.delay_ms:
        return ""
    return f"""    # while shedding, more inside (router + queue) than the router answers in {a.delay_ms} ms
    # at its last second's rate, and more than {a.max_queue}, is late: the admitted wait ~{a.delay_ms} ms
    acl busy srv_conn(shardserve/router) ge {min(a.max_in_flight, a.max_queue)}
    http-request set-var(txn.waiting) queue(shardserve) if busy shedding
    acl measured var(txn.waiting) -m found
    http-request set-var(txn.inside) srv_conn(shardserve/router),add(txn.waiting) if measured
    http-request set-var(txn.room) be_sess_rate(shardserve),mul({a.delay_ms}),div(1000) if measured
    acl crowded var(txn.inside) -m int gt {a.max_queue}
    acl late var(txn.inside),sub(txn.room) -m int gt 0
"""


def _returns(status: int, body: str, header: str) -> str:
    """An HAProxy rule answering at the edge with the router's JSON error shape."""
    return f'http-request return status {status} content-type application/json string "{body}" hdr {header}'


# What the edge answers itself, each in the API's JSON error shape (HAProxy can make these codes).
EDGE_ERRORS = {
    400: "bad request", 401: "missing or wrong API key", 403: "forbidden", 404: "not found",
    405: "method not allowed", 407: "proxy authentication required",
    408: "request timeout: the request did not arrive in time", 410: "gone",
    413: "request body too large", 425: "too early", 429: "too many requests",
    500: "edge internal error", 501: "not implemented",
    502: "bad gateway: no valid answer from the router", 503: "service unavailable: no router available",
    504: "gateway timeout: the router did not answer in time",
}
# a body up to this is read before the edge answers anyway (socket buffers); past it, a refusal
# goes through the draining service
UNREAD_BYTES = 65536


def _json(message: str, field: str | None = None) -> str:
    """The API's error body, escaped for an HAProxy double-quoted string."""
    return json.dumps({"error": message, "field": field}).replace('"', '\\"')


_OVERLOADED = _json("overloaded: edge queue full")
_UNAUTHORIZED = _json(EDGE_ERRORS[401])
_HEALTH_FLOOD = _json("too many health checks from this address")


def overloaded_response(retry_after_s: int = 1) -> str:
    """The raw HTTP response HAProxy sends on queue timeout (same JSON error shape as the router)."""
    # With its length and without `Connection: close` the client's connection stays open: under
    # overload most answers are 503s, and a new TCP connection for each one costs more CPU than the
    # query the edge protects.
    return ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Retry-After: {retry_after_s}\r\nCache-Control: no-cache\r\n"
            f"Content-Length: {len(OVERLOADED_BODY.encode())}\r\n\r\n" + OVERLOADED_BODY)


def write_edge(directory: Path, backend: str, listen: str, admission: Admission | None = None,
               api_key: str | None = None, access_log: bool = False, route_prefix: str = "/") -> Path:
    """Write config, 503 body and the refusing Lua service into `directory` (owner-only: the config
    holds the API key's digest)."""
    directory.mkdir(parents=True, exist_ok=True)
    errorfile = directory / "edge-503.http"
    errorfile.write_text(overloaded_response())
    lua = directory / "edge-refuse.lua"
    lua.write_text(refuse_lua())
    config = directory / "edge-haproxy.cfg"
    config.touch(mode=0o600)
    config.chmod(0o600)
    config.write_text(edge_config(backend, listen, admission, errorfile, api_key, access_log=access_log,
                                  lua_file=lua, route_prefix=route_prefix))
    return config


def haproxy_binary() -> str | None:
    found = shutil.which("haproxy") or "/usr/sbin/haproxy"
    return found if os.access(found, os.X_OK) else None


@dataclass(frozen=True)
class AccessLine:
    """The timers of one access-log line, in ms (-1: the request never got that far, e.g. a 503
    the edge answered itself): Tw waiting in the edge's queue, Tr the router's answer, Ta the
    whole request as the edge saw it; and `queued_before`, how many requests were waiting in the
    edge's queue ahead of this one when it joined (HAProxy's backend_queue counts the requests
    dequeued up to and including this one: 1 for the first in line, 0 when it never queued)."""

    status: int
    queue_ms: int
    router_ms: int
    total_ms: int
    queued_before: int = 0


def parse_access_line(line: str) -> AccessLine | None:
    """HAProxy's standard HTTP log line (`option httplog`): its `TR/Tw/Tc/Tr/Ta` field, the status
    after it and the `srv_queue/backend_queue` field; None for a line of another shape."""
    fields = line.split()
    for at, field in enumerate(fields[:-1]):
        timers = field.split("/")
        if len(timers) == 5 and all(t.lstrip("-+").isdigit() for t in timers) and fields[at + 1].isdigit():
            queues = fields[at + 7].split("/") if at + 7 < len(fields) else []
            queued = max(0, int(queues[1]) - 1) if len(queues) == 2 and queues[1].isdigit() else 0
            return AccessLine(int(fields[at + 1]), int(timers[1]), int(timers[3]), int(timers[4]), queued)
    return None


class EdgeProcess:
    """One HAProxy edge this process starts and stops (by its own pid): `listen` -> `backend`.
    `access_log`: a file the edge appends one line per request to (HAProxy's HTTP log format)."""

    def __init__(self, backend: str, listen: str, admission: Admission | None = None,
                 api_key: str | None = None, access_log: str | Path | None = None, route_prefix: str = "/"):
        self.backend, self.listen, self.route_prefix = backend, listen, route_prefix
        self.admission, self.api_key = admission or Admission(), api_key
        self.access_log = None if access_log is None else Path(access_log)
        self.process: subprocess.Popen | None = None
        self._work: tempfile.TemporaryDirectory | None = None

    def start(self) -> EdgeProcess:
        """Start HAProxy and check it stayed up. Whatever ends start() early (HAProxy exiting, or
        Ctrl-C inside it) leaves nothing running: it stops what it started before raising."""
        binary = haproxy_binary()
        if binary is None:
            raise ShardserveError("haproxy not found (Debian package `haproxy`; `make haproxy`)")
        try:
            self._work = tempfile.TemporaryDirectory(prefix="shardserve-edge-")
            config = write_edge(Path(self._work.name), self.backend, self.listen, self.admission,
                                self.api_key, access_log=self.access_log is not None,
                                route_prefix=self.route_prefix)
            command = [binary, "-db", "-f", str(config)]
            if self.access_log is None:
                self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            else:
                with open(self.access_log, "ab") as log:  # the child keeps its own descriptor
                    self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.PIPE)
            time.sleep(0.5)
            if self.process.poll() is not None:
                said = self.process.stderr.read() if self.process.stderr else b""
                error = said.decode(errors="replace").strip().splitlines()
                raise ShardserveError(f"edge haproxy on {self.listen} exited: {(error or ['?'])[-1]}")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.process is not None:
            procfs.terminate(self.process)
        if self._work is not None:
            self._work.cleanup()
            self._work = None

    def __enter__(self) -> EdgeProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
