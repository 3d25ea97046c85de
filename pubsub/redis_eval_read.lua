-- generated from redis.lua by caddy-sse (see redis_scripts.go); do not edit
--[==[
caddy-sse's Redis functions (Redis >= 7.0). Load once per primary with
  redis-cli FUNCTION LOAD REPLACE "$(cat pubsub/redis.lua)"
(caddy-sse loads it by itself when it first talks to a primary, and again
whenever Redis answers that it is missing).

A channel C with key prefix P ("sse:" by default) has the base key
  B = P{C}                  e.g. sse:{orders}
(the braces are a Redis Cluster hash tag: every key of a channel shares one
slot), and:
  B:s  a stream of the kept events; entry id "<time ms>-<seq>",
       fields y (event type) and d (data)
  B:m  a hash: e (epoch), s (last seq), t (last time ms),
       b (bytes kept), a (max age ms)
  B    the shard channel (SPUBLISH) that announces every event as
       "<epoch>:<seq>:<time>:<type length>:<type><data>"
B:s expires two max ages after the last event, B:m 7 days later. If B:m
is missing, or B:s while the last event is younger than the max age, the
channel's history is lost, and the next event starts a new epoch at seq 1,
which tells every old cursor that its replay is truncated. A channel quiet
for longer than its max age whose B:s expired keeps its epoch: every event
it held was too old to replay anyway, so no cursor missed anything.

A channel an instance's streams see before its first event gets its
epoch then (sse_open_v1): B:m with s 0 and t 0, which the first event
continues at seq 1. A client's id holds such a channel as <epoch>:0:0,
"before the first event of that epoch", so that a history lost while it
was away (the channel's first events with it) is told as truncated, as
any other.

FCALL sse_publish_v1 1 <B> <type> <data> [<count> [<max_age_ms> [<max_bytes>]]]
  Appends the event, trims the history to count events / max age / bytes
  (defaults 1000, 86400000, 4194304; an empty one is its default, one that
  is not a number is refused, and so is a B that is not P{C}), announces
  it, and returns
  {epoch, seq, time}. Each call publishes: a client that sends it again
  after a timeout (go-redis retries by default) may publish twice.
FCALL sse_publish_once_v1 1 <B> <token> <ttl_ms> <type> <data> [<count> [<max_age_ms> [<max_bytes>]]]
  The same, at most once per token: the first call with a token publishes
  and keeps its reply for ttl_ms under B:p:<token>; a later call with that
  token (a retry of the same publish) returns the kept reply. caddy-sse
  publishes with it, a random token per publish, so that the retries of a
  call that timed out while Redis was stalled add no event.
FCALL_RO sse_read_v1 1 <B> <limit> [<epoch> <seq> <time>]
  Returns {epoch, seq, time, truncated, n, id1, type1, data1, ...}: the
  channel's head, and the events after the given position by caddy-sse's
  replay rules (only the head without a position).

The _v2 forms do the same and declare the keys they use, not B (which is
only the shard channel, never a key): while a cluster migrates the slot,
Redis then runs them where the keys are, or answers TRYAGAIN while they are
split between two primaries; the _v1 forms, whose declared key B never
exists, are sent to the primary the slot goes to before its keys are there.
caddy-sse calls the _v2 forms; backends should too on a Redis Cluster.
FCALL sse_publish_v2 2 <B>:m <B>:s <type> <data> [...]
FCALL sse_publish_once_v2 3 <B>:m <B>:s <B>:p:<token> <token> <ttl_ms> <type> <data> [...]
FCALL_RO sse_read_v2 2 <B>:m <B>:s <limit> [<epoch> <seq> <time>]
FCALL_RO sse_read_v3 2 <B>:m <B>:s <limit> [<epoch> <seq> <time>]
  sse_read_v2 under a new name, which caddy-sse calls: a cursor just before
  the oldest event kept, with a time not its event's, was also replayed the
  aged entries the stream still held; sse_read_v2 reads the same now, but a
  Redis loaded with the earlier library has it, and only a missing function
  makes an instance load the library again.
FCALL sse_publish_once_v3 3 <B>:m <B>:s <B>:p:<token> <token> <ttl_ms> <type> <data> [...]
  sse_publish_once_v2 whose reply is {epoch, seq, time, repeat}: repeat is 1
  when the reply is the one kept for the token (nothing published now), 0
  when this call published. caddy-sse calls it to count what it publishes.
FCALL sse_open_v1 2 <B>:m <B>:s
  Returns {epoch, 0, 0}: the position before the first event of the
  channel's epoch, which it starts if the channel has none (B:m then
  expires as after an event with the default max age). caddy-sse calls
  it for a channel whose head it reads empty, and puts that position in the
  ids it gives clients.
FCALL_RO sse_read_v4 2 <B>:m <B>:s <limit> [<epoch> <seq> <time>]
  sse_read_v3 under a new name, which caddy-sse calls: a position before
  the first event (0 0 0) read of a channel that sse_open_v1 gave an epoch
  and that has no event yet was answered as truncated.
]==]

local OVERHEAD = 64 -- what an entry costs besides its type and data
local META_GRACE = 604800000 -- B:m outlives B:s by 7 days (ms)
local MAX_TYPE = 200
local MAX_CHANNEL = 200 -- bytes of a channel's name (SPEC S1)
local RESERVED = { server_closing = true, sse_truncated = true, sse_rejected = true, sse_degraded = true }

local function num(x)
  return string.format('%.0f', x)
end

-- whole_ms reports whether x is a whole number of milliseconds from 1 to
-- 2^52, as PEXPIRE and SET PX take. A fraction (a backend's 1.1 * 3600000
-- is 3960000.0000000005), NaN or a huge value (written with an exponent)
-- was refused by them only after the event was appended: the caller was
-- told the publish failed, every instance delivered it anyway, and each
-- retry added another.
local function whole_ms(x)
  return x ~= nil and x >= 1 and x <= 4503599627370496 and x == math.floor(x)
end

local function check_type(typ)
  if #typ > MAX_TYPE then
    return 'ERR sse: event type longer than 200 bytes'
  end
  if string.find(typ, '[\r\n%z]') then
    return 'ERR sse: event type contains a line break or NUL'
  end
  if RESERVED[typ] then
    return 'ERR sse: event type ' .. typ .. ' is reserved'
  end
  return nil
end

-- check_base refuses a base key that is not <prefix>{<channel>} (the
-- prefix holds no brace; the channel, 1 to 200 bytes, no brace or control
-- character): a key without its braces, or a _v2 key given to a _v1 form
-- (sse:{a}:m), was published to a channel no stream can have, and the
-- caller was told it worked. A comma passes: the instances' own channel of
-- throttles has one, which is why no stream can name it.
local function check_base(base)
  local channel = type(base) == 'string' and string.match(base, '^[^{}]*{([^{}]+)}$')
  if not channel or #channel > MAX_CHANNEL or string.find(channel, '%c') then
    return 'ERR sse: the key must be <prefix>{<channel>}, a channel of 1 to 200 bytes without {, } or control characters'
  end
  return nil
end

-- limit reads an optional limit: absent (or empty) is the default, else a
-- number; not one (nil) is refused by the caller. tonumber(x) or default
-- published a count of "1k" or a max age of "24h" with the defaults, and
-- the caller was not told.
local function limit(arg, default)
  if arg == nil or arg == '' then return default end
  return tonumber(arg)
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), t
end

-- new_epoch is the epoch a new history starts, from Redis' clock (TIME):
-- one that a lost history of the channel had is unlikely
local function new_epoch(clock)
  local epoch = (tonumber(clock[1]) * 1000000 + tonumber(clock[2])) % 4294967296
  if epoch == 0 then epoch = 1 end
  return epoch
end

local function parse_id(id)
  local t, s = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(t), tonumber(s)
end

-- trim drops the oldest entries while the stream holds more than count
-- events or bytes, or entries older than cutoff; it returns the bytes left.
-- A publish usually drops no entry or one: it reads the oldest two first
-- (turning 64 entries into Lua tables made a publish cost Redis 69 us),
-- and more at a time only while whole batches go.
local function trim(skey, count, max_bytes, cutoff, bytes)
  local len = redis.call('XLEN', skey)
  local keep_from = nil
  local dropped = 0
  local start = '-'
  local want = 2
  while len > 0 and keep_from == nil do
    local batch = redis.call('XRANGE', skey, start, '+', 'COUNT', want)
    if #batch == 0 then break end
    for _, entry in ipairs(batch) do
      local t = parse_id(entry[1])
      if len > count or bytes > max_bytes or t < cutoff then
        local f = entry[2]
        local size = OVERHEAD
        for i = 2, #f, 2 do size = size + #f[i] end
        bytes = bytes - size
        len = len - 1
        dropped = dropped + 1
      else
        keep_from = entry[1]
        break
      end
    end
    if keep_from == nil then
      start = '(' .. batch[#batch][1]
      want = math.min(want * 4, 64)
    end
  end
  if dropped > 0 then
    if keep_from then
      redis.call('XTRIM', skey, 'MINID', keep_from)
    else
      redis.call('XTRIM', skey, 'MAXLEN', 0)
    end
  end
  if bytes < 0 then bytes = 0 end
  return bytes
end

local function publish(keys, args)
  local base = keys[1]
  -- a call without its data (or type) published an empty event
  if args[1] == nil or args[2] == nil or #args > 5 then
    return redis.error_reply('ERR sse: the arguments are <type> <data> [<count> [<max_age_ms> [<max_bytes>]]]')
  end
  local typ, data = args[1], args[2]
  local count = limit(args[3], 1000)
  local max_age = limit(args[4], 86400000)
  local max_bytes = limit(args[5], 4194304)
  local err = check_base(base) or check_type(typ)
  if err then return redis.error_reply(err) end
  -- written so that NaN fails too (a NaN count or byte cap trimmed nothing)
  if not (count and max_bytes and count >= 1 and max_bytes >= 1 and whole_ms(max_age)) then
    return redis.error_reply('ERR sse: count and max_bytes must be positive, max_age_ms a positive integer')
  end
  if #data + #typ + OVERHEAD > max_bytes then
    return redis.error_reply('ERR sse: event larger than max_bytes')
  end
  -- an ACL user has no channel unless granted (Redis 7): refuse before
  -- writing, as a SPUBLISH refused at the end left the event in the
  -- history, unannounced, though the caller was told it failed
  if not redis.acl_check_cmd('spublish', base, '') then
    return redis.error_reply('NOPERM sse: this user may not publish to the shard channel ' .. base ..
      ' (grant it the channels of the key prefix, e.g. &sse:*)')
  end

  local skey, mkey = base .. ':s', base .. ':m'
  local meta = redis.call('HMGET', mkey, 'e', 's', 't', 'b', 'a')
  local epoch, seq, last, bytes = tonumber(meta[1]), tonumber(meta[2]), tonumber(meta[3]), tonumber(meta[4])
  local kept_age = tonumber(meta[5]) or max_age
  local now, clock = now_ms()
  local lost = epoch == nil or seq == nil or last == nil
  -- seq 0: an epoch sse_open_v1 started, which has no stream yet
  if not lost and seq > 0 and redis.call('EXISTS', skey) == 0 then
    if now - last >= kept_age then
      -- the stream expired on a quiet channel (or went when every event in
      -- it was older than the max age): nothing a cursor could replay is
      -- gone, so the epoch goes on, and open streams miss nothing
      bytes = 0
    else
      lost = true -- evicted, flushed or failed over with events in it
    end
  end
  if lost then
    -- a new channel, or its history was lost: start a new epoch so that
    -- old cursors are told
    redis.call('DEL', skey, mkey)
    epoch = new_epoch(clock)
    seq, last, bytes = 0, 0, 0
  end
  seq = seq + 1
  local t = math.max(now, last)
  local id = num(t) .. '-' .. num(seq)
  redis.call('XADD', skey, id, 'y', typ, 'd', data)
  bytes = trim(skey, count, max_bytes, now - max_age, (bytes or 0) + #typ + #data + OVERHEAD)
  redis.call('HSET', mkey, 'e', num(epoch), 's', num(seq), 't', num(t), 'b', num(bytes), 'a', num(max_age))
  redis.call('PEXPIRE', skey, 2 * max_age)
  redis.call('PEXPIRE', mkey, 2 * max_age + META_GRACE)
  redis.call('SPUBLISH', base, num(epoch) .. ':' .. num(seq) .. ':' .. num(t) .. ':' .. #typ .. ':' .. typ .. data)
  return { num(epoch), num(seq), num(t) }
end

-- publish_once_repeat is publish at most once per token: a retry of a call
-- (the same token) gets the first call's reply. It also returns whether the
-- reply is that of an earlier call (nothing published now).
local function publish_once_repeat(keys, args)
  if #args > 7 then
    return redis.error_reply('ERR sse: the arguments are <token> <ttl_ms> <type> <data> [<count> [<max_age_ms> [<max_bytes>]]]')
  end
  local token, ttl = args[1] or '', tonumber(args[2] or '')
  if token == '' or string.find(token, '[^%w_-]') or #token > 64 then
    return redis.error_reply('ERR sse: the token must be 1 to 64 letters, digits, - or _')
  end
  if not whole_ms(ttl) then
    return redis.error_reply('ERR sse: ttl_ms must be a positive integer')
  end
  local pkey = keys[1] .. ':p:' .. token
  local kept = redis.call('GET', pkey)
  if kept then
    local e, s, t = string.match(kept, '^(%d+):(%d+):(%d+)$')
    if e then return { e, s, t }, true end
  end
  local reply = publish(keys, { args[3], args[4], args[5], args[6], args[7] })
  if type(reply) == 'table' and reply[1] ~= nil then
    redis.call('SET', pkey, reply[1] .. ':' .. reply[2] .. ':' .. reply[3], 'PX', ttl)
  end
  return reply, false
end

local function publish_once(keys, args)
  local reply = publish_once_repeat(keys, args)
  return reply
end

-- the read side: caddy-sse's replay rules (SPEC S5), the same as
-- replay.Select of its in-memory log

local function flat(out, entries)
  for _, entry in ipairs(entries) do
    local f = entry[2]
    local typ, data = '', ''
    for i = 1, #f, 2 do
      if f[i] == 'y' then typ = f[i + 1] elseif f[i] == 'd' then data = f[i + 1] end
    end
    out[#out + 1] = entry[1]
    out[#out + 1] = typ
    out[#out + 1] = data
  end
  return out
end

local function result(head, truncated, entries)
  local out = { num(head[1]), num(head[2]), num(head[3]), truncated and 1 or 0, #entries }
  return flat(out, entries)
end

local function newest(skey, floor, limit, head)
  local rev = redis.call('XREVRANGE', skey, '+', floor, 'COUNT', limit)
  local entries = {}
  for i = #rev, 1, -1 do entries[#entries + 1] = rev[i] end
  return result(head, true, entries)
end

local function tail(skey, start, floor, limit, head)
  local entries = redis.call('XRANGE', skey, start, '+', 'COUNT', limit + 1)
  if #entries > limit then return newest(skey, floor, limit, head) end
  return result(head, false, entries)
end

local function read(keys, args)
  local base = keys[1]
  local limit = tonumber(args[1])
  local now = now_ms()
  local has_after = args[2] ~= nil
  local ae, as, at = tonumber(args[2] or '0'), tonumber(args[3] or '0'), tonumber(args[4] or '0')
  local skey, mkey = base .. ':s', base .. ':m'
  local meta = redis.call('HMGET', mkey, 'e', 's', 't', 'a')
  local e, s, t, a = tonumber(meta[1]), tonumber(meta[2]), tonumber(meta[3]), tonumber(meta[4])
  if e == nil or s == nil or t == nil then
    -- no history: the head is the zero position
    local truncated = has_after and not (ae == 0 and as == 0)
    return result({ 0, 0, 0 }, truncated, {})
  end
  local head = { e, s, t }
  if not has_after then return result(head, false, {}) end

  -- events older than the max age are no longer retained
  local floor = '-'
  if a and a > 0 then floor = num(math.max(now - a, 0)) .. '-0' end
  local first = redis.call('XRANGE', skey, floor, '+', 'COUNT', 1)[1]
  local first_t, first_s
  if first then first_t, first_s = parse_id(first[1]) end

  if ae == 0 and as == 0 then
    if s == 0 then return result(head, false, {}) end -- no event yet
    if first and first_s == 1 then return tail(skey, floor, floor, limit, head) end
    return newest(skey, floor, limit, head)
  end
  if ae ~= e or as > s then return newest(skey, floor, limit, head) end
  if as == s then
    if at ~= t then return newest(skey, floor, limit, head) end
    return result(head, false, {})
  end
  if not first or first_s > as + 1 then return newest(skey, floor, limit, head) end
  if as >= first_s then
    -- the event at the cursor must still be the one the client saw
    local id = num(at) .. '-' .. num(as)
    if #redis.call('XRANGE', skey, id, id) == 0 then return newest(skey, floor, limit, head) end
    return tail(skey, '(' .. id, floor, limit, head)
  end
  -- the cursor is just before the oldest retained event: the event after
  -- the cursor cannot be older than the cursor's
  if first_t < at then return newest(skey, floor, limit, head) end
  -- replay from that event: after the cursor's id would also take the
  -- aged entries still in the stream (not trimmed until the next publish)
  -- whose id is above it when the cursor's time is not its event's
  return tail(skey, first[1], floor, limit, head)
end

-- the _v2 forms: KEYS are B:m, B:s (and B:p:<token>), the keys the call
-- uses, so that a cluster sends it where they are (see the top)

local function base_of(keys, n)
  local mkey = keys[1] or ''
  if #keys ~= n or string.sub(mkey, -2) ~= ':m' then return nil end
  local base = string.sub(mkey, 1, -3)
  if keys[2] ~= base .. ':s' then return nil end
  return base
end

local KEYS_ERR = 'ERR sse: the keys must be <B>:m <B>:s'

local function publish_v2(keys, args)
  local base = base_of(keys, 2)
  if not base then return redis.error_reply(KEYS_ERR) end
  return publish({ base }, args)
end

-- once_base returns B of the publish-once forms' keys (B:m, B:s and
-- B:p:<token>), or nil if they are not those
local function once_base(keys, args)
  local base = base_of(keys, 3)
  if base and keys[3] == base .. ':p:' .. (args[1] or '') then return base end
  return nil
end

local function publish_once_v2(keys, args)
  local base = once_base(keys, args)
  if not base then return redis.error_reply(KEYS_ERR .. ' <B>:p:<token>') end
  return publish_once({ base }, args)
end

-- publish_once_v3 is publish_once_v2 whose reply says, fourth, whether it
-- is an earlier call's (1) or a publish now (0): caddy-sse counts what it
-- publishes, and a keyed retry after a partial failure is answered with the
-- first attempt's events for the channels it published
local function publish_once_v3(keys, args)
  local base = once_base(keys, args)
  if not base then return redis.error_reply(KEYS_ERR .. ' <B>:p:<token>') end
  local reply, repeated = publish_once_repeat({ base }, args)
  if type(reply) == 'table' and reply[1] ~= nil then
    reply[4] = repeated and 1 or 0
  end
  return reply
end

-- open starts the epoch of a channel that has none (sse_open_v1), and
-- returns the position before its first event
local function open(keys, args)
  local base = base_of(keys, 2)
  if not base then return redis.error_reply(KEYS_ERR) end
  local err = check_base(base)
  if err then return redis.error_reply(err) end
  if #args > 0 then return redis.error_reply('ERR sse: sse_open_v1 takes no argument') end
  local mkey = base .. ':m'
  local epoch = tonumber(redis.call('HMGET', mkey, 'e')[1])
  if epoch == nil then
    epoch = new_epoch(select(2, now_ms()))
    redis.call('HSET', mkey, 'e', num(epoch), 's', '0', 't', '0', 'b', '0')
    -- as B:m after an event with the default max age: a client away
    -- longer is told truncated, the safe side, if no event came since
    redis.call('PEXPIRE', mkey, 2 * 86400000 + META_GRACE)
  end
  return { num(epoch), '0', '0' }
end

local function read_v2(keys, args)
  local base = base_of(keys, 2)
  if not base then return redis.error_reply(KEYS_ERR) end
  return read({ base }, args)
end


return read_v2(KEYS, ARGV)
