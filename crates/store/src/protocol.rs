//! The c10d TCPStore wire protocol (torch >= 2.2) as a pure codec over byte buffers.
//!
//! No I/O happens here: [`Request::parse`] looks at the bytes received so far and either returns a
//! complete request and how many bytes it used, says how many bytes it needs at least, or rejects
//! the input. It never panics and never allocates more than the bytes it was given, so a hostile
//! peer can cost at most one connection. Lengths are checked against PyTorch's own limits *before*
//! waiting for the bytes they announce, which bounds what a connection may buffer.
//!
//! Integers are little-endian (the native order of every platform torch ships on).

use std::fmt;

/// The magic that follows opcode 0 (VALIDATE) as a u32: bytes `CE F7 85 3C` on the wire.
pub const VALIDATE_MAGIC: u32 = 0x3C85_F7CE;
/// Longest key PyTorch's server accepts.
pub(crate) const MAX_KEY_LEN: u64 = 8 * 1024;
/// Longest value PyTorch's server accepts.
pub const MAX_VALUE_LEN: u64 = 8 * 1024 * 1024;
/// Most keys in one request (CHECK, WAIT, MULTI_GET, MULTI_SET).
pub(crate) const MAX_KEYS: u64 = 131_072;
/// Upper bound for one whole request, so many maximal values cannot add up without limit.
pub const MAX_REQUEST_LEN: usize = 256 * 1024 * 1024;

/// CHECK reply: every key exists.
pub(crate) const CHECK_READY: u8 = 0;
/// CHECK reply: at least one key is missing.
pub const CHECK_NOT_READY: u8 = 1;
/// WAIT/BARRIER reply: the keys exist (or the barrier is complete).
pub const STOP_WAITING: u8 = 0;
/// CANCEL_WAIT reply.
pub const WAIT_CANCELED: u8 = 1;

/// Opcodes of torch >= 2.2 (VALIDATE inserted at 0 shifted the older ones up by one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Op {
    Validate = 0,
    Set = 1,
    CompareSet = 2,
    Get = 3,
    Add = 4,
    Check = 5,
    Wait = 6,
    GetNumKeys = 7,
    DeleteKey = 8,
    Append = 9,
    MultiGet = 10,
    MultiSet = 11,
    CancelWait = 12,
    Ping = 13,
    QueuePush = 14,
    QueuePop = 15,
    QueueLen = 16,
    ListKeys = 17,
    Barrier = 18,
}

impl Op {
    pub(crate) fn from_u8(b: u8) -> Option<Op> {
        use Op::*;
        Some(match b {
            0 => Validate,
            1 => Set,
            2 => CompareSet,
            3 => Get,
            4 => Add,
            5 => Check,
            6 => Wait,
            7 => GetNumKeys,
            8 => DeleteKey,
            9 => Append,
            10 => MultiGet,
            11 => MultiSet,
            12 => CancelWait,
            13 => Ping,
            14 => QueuePush,
            15 => QueuePop,
            16 => QueueLen,
            17 => ListKeys,
            18 => Barrier,
            _ => return None,
        })
    }
}

/// One client request. Keys and values are raw bytes: torch sends keys with a "/" prefix and
/// values that need not be UTF-8.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    Validate {
        magic: u32,
    },
    Set {
        key: Vec<u8>,
        value: Vec<u8>,
    },
    CompareSet {
        key: Vec<u8>,
        expected: Vec<u8>,
        desired: Vec<u8>,
    },
    Get {
        key: Vec<u8>,
    },
    Add {
        key: Vec<u8>,
        delta: i64,
    },
    Check {
        keys: Vec<Vec<u8>>,
    },
    Wait {
        keys: Vec<Vec<u8>>,
    },
    GetNumKeys,
    DeleteKey {
        key: Vec<u8>,
    },
    Append {
        key: Vec<u8>,
        value: Vec<u8>,
    },
    MultiGet {
        keys: Vec<Vec<u8>>,
    },
    MultiSet {
        pairs: Vec<(Vec<u8>, Vec<u8>)>,
    },
    CancelWait,
    Ping {
        nonce: u32,
    },
    QueuePush {
        key: Vec<u8>,
        value: Vec<u8>,
    },
    QueuePop {
        key: Vec<u8>,
    },
    QueueLen {
        key: Vec<u8>,
    },
    ListKeys,
    Barrier {
        key: Vec<u8>,
        world_size: i64,
    },
}

/// What [`Request::parse`] found in the buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed {
    /// A whole request that used the first `len` bytes.
    Complete(Request, usize),
    /// The buffer holds a prefix of a valid request; at least `need` bytes in all are required
    /// before parsing again can make progress.
    Incomplete { need: usize },
}

/// Input that no valid client sends; the connection that sent it is closed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProtocolError {
    UnknownOpcode(u8),
    KeyTooLong(u64),
    ValueTooLong(u64),
    TooManyKeys(u64),
    RequestTooLarge(usize),
}

impl fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProtocolError::UnknownOpcode(b) => write!(f, "unknown opcode {b}"),
            ProtocolError::KeyTooLong(n) => {
                write!(f, "key of {n} bytes exceeds the limit of {MAX_KEY_LEN}")
            }
            ProtocolError::ValueTooLong(n) => {
                write!(f, "value of {n} bytes exceeds the limit of {MAX_VALUE_LEN}")
            }
            ProtocolError::TooManyKeys(n) => {
                write!(
                    f,
                    "request names {n} keys, more than the limit of {MAX_KEYS}"
                )
            }
            ProtocolError::RequestTooLarge(n) => {
                write!(
                    f,
                    "request of {n} bytes exceeds the limit of {MAX_REQUEST_LEN}"
                )
            }
        }
    }
}

impl std::error::Error for ProtocolError {}

/// Why a read stopped: not enough bytes (with the total needed), or a bad value.
enum Stop {
    Need(usize),
    Bad(ProtocolError),
}

impl From<ProtocolError> for Stop {
    fn from(e: ProtocolError) -> Self {
        Stop::Bad(e)
    }
}

/// A cursor over the received bytes. Every read checks the remaining length first.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// Where a field of `n` bytes starting at `pos` ends, if `have` bytes hold it: a request past
/// [`MAX_REQUEST_LEN`] is refused before its bytes are waited for.
fn field_end(pos: usize, n: usize, have: usize) -> Result<usize, Stop> {
    let end = pos
        .checked_add(n)
        .ok_or(Stop::Bad(ProtocolError::RequestTooLarge(usize::MAX)))?;
    if end > MAX_REQUEST_LEN {
        return Err(Stop::Bad(ProtocolError::RequestTooLarge(end)));
    }
    if end > have {
        return Err(Stop::Need(end));
    }
    Ok(end)
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Stop> {
        let end = field_end(self.pos, n, self.buf.len())?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, Stop> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, Stop> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, Stop> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    fn i64(&mut self) -> Result<i64, Stop> {
        Ok(self.u64()? as i64)
    }

    fn bytes(&mut self, limit: u64, too_long: fn(u64) -> ProtocolError) -> Result<Vec<u8>, Stop> {
        let n = self.u64()?;
        if n > limit {
            return Err(Stop::Bad(too_long(n)));
        }
        Ok(self.take(n as usize)?.to_vec())
    }

    fn key(&mut self) -> Result<Vec<u8>, Stop> {
        self.bytes(MAX_KEY_LEN, ProtocolError::KeyTooLong)
    }

    fn value(&mut self) -> Result<Vec<u8>, Stop> {
        self.bytes(MAX_VALUE_LEN, ProtocolError::ValueTooLong)
    }

    fn count(&mut self) -> Result<usize, Stop> {
        let n = self.u64()?;
        if n > MAX_KEYS {
            return Err(Stop::Bad(ProtocolError::TooManyKeys(n)));
        }
        Ok(n as usize)
    }

    fn keys(&mut self) -> Result<Vec<Vec<u8>>, Stop> {
        let n = self.count()?;
        // Reserve by what has arrived, not by what was announced: each key takes >= 8 bytes.
        let mut keys = Vec::with_capacity(n.min((self.buf.len() - self.pos) / 8));
        for _ in 0..n {
            keys.push(self.key()?);
        }
        Ok(keys)
    }
}

impl Request {
    /// Parses one request from the start of `buf`.
    pub fn parse(buf: &[u8]) -> Result<Parsed, ProtocolError> {
        let mut r = Reader { buf, pos: 0 };
        match Self::read(&mut r) {
            Ok(req) => Ok(Parsed::Complete(req, r.pos)),
            Err(Stop::Need(need)) => Ok(Parsed::Incomplete { need }),
            Err(Stop::Bad(e)) => Err(e),
        }
    }

    fn read(r: &mut Reader<'_>) -> Result<Request, Stop> {
        let code = r.u8()?;
        let op = Op::from_u8(code).ok_or(ProtocolError::UnknownOpcode(code))?;
        Ok(match op {
            Op::Validate => Request::Validate { magic: r.u32()? },
            Op::Set => Request::Set {
                key: r.key()?,
                value: r.value()?,
            },
            Op::CompareSet => Request::CompareSet {
                key: r.key()?,
                expected: r.value()?,
                desired: r.value()?,
            },
            Op::Get => Request::Get { key: r.key()? },
            Op::Add => Request::Add {
                key: r.key()?,
                delta: r.i64()?,
            },
            Op::Check => Request::Check { keys: r.keys()? },
            Op::Wait => Request::Wait { keys: r.keys()? },
            Op::GetNumKeys => Request::GetNumKeys,
            Op::DeleteKey => Request::DeleteKey { key: r.key()? },
            Op::Append => Request::Append {
                key: r.key()?,
                value: r.value()?,
            },
            Op::MultiGet => Request::MultiGet { keys: r.keys()? },
            Op::MultiSet => {
                let n = r.count()?;
                let mut pairs = Vec::with_capacity(n.min((r.buf.len() - r.pos) / 16));
                for _ in 0..n {
                    pairs.push((r.key()?, r.value()?));
                }
                Request::MultiSet { pairs }
            }
            Op::CancelWait => Request::CancelWait,
            Op::Ping => Request::Ping { nonce: r.u32()? },
            Op::QueuePush => Request::QueuePush {
                key: r.key()?,
                value: r.value()?,
            },
            Op::QueuePop => Request::QueuePop { key: r.key()? },
            Op::QueueLen => Request::QueueLen { key: r.key()? },
            Op::ListKeys => Request::ListKeys,
            Op::Barrier => Request::Barrier {
                key: r.key()?,
                world_size: r.i64()?,
            },
        })
    }

    /// Appends this request's wire form to `out` (used by nrun's own client).
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Request::Validate { magic } => {
                out.push(Op::Validate as u8);
                out.extend_from_slice(&magic.to_le_bytes());
            }
            Request::Set { key, value } => {
                out.push(Op::Set as u8);
                put_bytes(out, key);
                put_bytes(out, value);
            }
            Request::CompareSet {
                key,
                expected,
                desired,
            } => {
                out.push(Op::CompareSet as u8);
                put_bytes(out, key);
                put_bytes(out, expected);
                put_bytes(out, desired);
            }
            Request::Get { key } => {
                out.push(Op::Get as u8);
                put_bytes(out, key);
            }
            Request::Add { key, delta } => {
                out.push(Op::Add as u8);
                put_bytes(out, key);
                out.extend_from_slice(&delta.to_le_bytes());
            }
            Request::Check { keys } => put_keys(out, Op::Check, keys),
            Request::Wait { keys } => put_keys(out, Op::Wait, keys),
            Request::GetNumKeys => out.push(Op::GetNumKeys as u8),
            Request::DeleteKey { key } => {
                out.push(Op::DeleteKey as u8);
                put_bytes(out, key);
            }
            Request::Append { key, value } => {
                out.push(Op::Append as u8);
                put_bytes(out, key);
                put_bytes(out, value);
            }
            Request::MultiGet { keys } => put_keys(out, Op::MultiGet, keys),
            Request::MultiSet { pairs } => {
                out.push(Op::MultiSet as u8);
                out.extend_from_slice(&(pairs.len() as u64).to_le_bytes());
                for (k, v) in pairs {
                    put_bytes(out, k);
                    put_bytes(out, v);
                }
            }
            Request::CancelWait => out.push(Op::CancelWait as u8),
            Request::Ping { nonce } => {
                out.push(Op::Ping as u8);
                out.extend_from_slice(&nonce.to_le_bytes());
            }
            Request::QueuePush { key, value } => {
                out.push(Op::QueuePush as u8);
                put_bytes(out, key);
                put_bytes(out, value);
            }
            Request::QueuePop { key } => {
                out.push(Op::QueuePop as u8);
                put_bytes(out, key);
            }
            Request::QueueLen { key } => {
                out.push(Op::QueueLen as u8);
                put_bytes(out, key);
            }
            Request::ListKeys => out.push(Op::ListKeys as u8),
            Request::Barrier { key, world_size } => {
                out.push(Op::Barrier as u8);
                put_bytes(out, key);
                out.extend_from_slice(&world_size.to_le_bytes());
            }
        }
    }
}

/// One field of a request, as [`FrameScan`] walks it.
#[derive(Clone, Copy)]
enum Field {
    /// That many bytes (a u32 or an i64).
    Fixed(usize),
    Key,
    Value,
}

/// The fields after the opcode: those read once, then those read once per item of a counted
/// list (CHECK, WAIT, MULTI_GET, MULTI_SET), if the request has one.
fn shape(op: Op) -> (&'static [Field], Option<&'static [Field]>) {
    use Field::*;
    match op {
        Op::Validate | Op::Ping => (&[Fixed(4)], None),
        Op::Set | Op::Append | Op::QueuePush => (&[Key, Value], None),
        Op::CompareSet => (&[Key, Value, Value], None),
        Op::Get | Op::DeleteKey | Op::QueuePop | Op::QueueLen => (&[Key], None),
        Op::Add | Op::Barrier => (&[Key, Fixed(8)], None),
        Op::Check | Op::Wait | Op::MultiGet => (&[], Some(&[Key])),
        Op::MultiSet => (&[], Some(&[Key, Value])),
        Op::GetNumKeys | Op::CancelWait | Op::ListKeys => (&[], None),
    }
}

/// What [`FrameScan::scan`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Scanned {
    /// A whole request lies in the first `len` bytes: [`Request::parse`] of them completes.
    Complete(usize),
    /// At least `need` bytes in all are required before scanning again can make progress.
    Incomplete { need: usize },
}

/// Finds where a request ends without building it, resuming where the previous call stopped.
///
/// Bytes of a large request arrive over many reads. Parsing from the start after each read
/// would cost time quadratic in the request's size (a CHECK of 25,000 8 KiB keys is 195 MiB);
/// the scan instead remembers how far it got, so every byte is looked at once. Once it says
/// [`Scanned::Complete`], one [`Request::parse`] builds the request. Limits are checked as
/// [`Request::parse`] checks them, before waiting for the bytes a length announces.
#[derive(Debug, Default)]
pub struct FrameScan {
    /// Offset of the next field to read (every field before it is whole).
    pos: usize,
    op: Option<Op>,
    /// Next field of the head.
    head: usize,
    /// Items of the list still to read, once the count has been read.
    left: Option<u64>,
    /// Next field of the current item.
    item: usize,
}

impl FrameScan {
    /// Whether nothing of a request has been scanned yet.
    pub(crate) fn is_fresh(&self) -> bool {
        self.op.is_none()
    }

    /// Scans `buf`, which starts with the request and extends the buffer of the previous call.
    pub fn scan(&mut self, buf: &[u8]) -> Result<Scanned, ProtocolError> {
        match self.walk(buf) {
            Ok(len) => Ok(Scanned::Complete(len)),
            Err(Stop::Need(need)) => Ok(Scanned::Incomplete { need }),
            Err(Stop::Bad(e)) => Err(e),
        }
    }

    /// Offset of the end of a field of `n` bytes starting at `self.pos`, if it has arrived.
    fn end(&self, buf: &[u8], n: usize) -> Result<usize, Stop> {
        field_end(self.pos, n, buf.len())
    }

    fn u64_at(&self, buf: &[u8]) -> Result<u64, Stop> {
        let end = self.end(buf, 8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(&buf[self.pos..end]);
        Ok(u64::from_le_bytes(a))
    }

    /// Steps over one field, advancing `pos` only once it has wholly arrived.
    fn field(&mut self, buf: &[u8], f: Field) -> Result<(), Stop> {
        let n = match f {
            Field::Fixed(n) => n,
            Field::Key | Field::Value => {
                let (limit, too_long): (u64, fn(u64) -> ProtocolError) = match f {
                    Field::Key => (MAX_KEY_LEN, ProtocolError::KeyTooLong),
                    _ => (MAX_VALUE_LEN, ProtocolError::ValueTooLong),
                };
                let n = self.u64_at(buf)?;
                if n > limit {
                    return Err(Stop::Bad(too_long(n)));
                }
                // The length is read again on the next call if the bytes are not all here.
                let start = self.pos;
                self.pos += 8;
                let r = self.end(buf, n as usize);
                self.pos = start;
                r?;
                8 + n as usize
            }
        };
        self.pos = self.end(buf, n)?;
        Ok(())
    }

    fn walk(&mut self, buf: &[u8]) -> Result<usize, Stop> {
        let op = match self.op {
            Some(op) => op,
            None => {
                let code = *buf.first().ok_or(Stop::Need(1))?;
                let op = Op::from_u8(code).ok_or(ProtocolError::UnknownOpcode(code))?;
                self.pos = 1;
                self.op = Some(op);
                op
            }
        };
        let (head, list) = shape(op);
        while let Some(&f) = head.get(self.head) {
            self.field(buf, f)?;
            self.head += 1;
        }
        let Some(item) = list else {
            return Ok(self.pos);
        };
        let mut left = match self.left {
            Some(n) => n,
            None => {
                let n = self.u64_at(buf)?;
                if n > MAX_KEYS {
                    return Err(Stop::Bad(ProtocolError::TooManyKeys(n)));
                }
                self.pos += 8;
                self.left = Some(n);
                n
            }
        };
        while left > 0 {
            while let Some(&f) = item.get(self.item) {
                self.field(buf, f)?;
                self.item += 1;
            }
            self.item = 0;
            left -= 1;
            self.left = Some(left);
        }
        Ok(self.pos)
    }
}

/// Writes a length-prefixed byte string (a key, a value, or a reply value).
pub(crate) fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(b);
}

/// Writes a numeric reply.
pub(crate) fn put_i64(out: &mut Vec<u8>, v: i64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_keys(out: &mut Vec<u8>, op: Op, keys: &[Vec<u8>]) {
    out.push(op as u8);
    out.extend_from_slice(&(keys.len() as u64).to_le_bytes());
    for k in keys {
        put_bytes(out, k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(req: Request) {
        let mut buf = Vec::new();
        req.encode(&mut buf);
        assert_eq!(
            Request::parse(&buf),
            Ok(Parsed::Complete(req.clone(), buf.len()))
        );
        // Every strict prefix is incomplete, and says it needs more than it has.
        for cut in 0..buf.len() {
            match Request::parse(&buf[..cut]) {
                Ok(Parsed::Incomplete { need }) => assert!(need > cut && need <= buf.len()),
                other => panic!("prefix {cut} of {req:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn every_request_roundtrips_and_prefixes_are_incomplete() {
        let k = b"/key".to_vec();
        let v = vec![0u8, 255, 7];
        for req in [
            Request::Validate {
                magic: VALIDATE_MAGIC,
            },
            Request::Set {
                key: k.clone(),
                value: v.clone(),
            },
            Request::CompareSet {
                key: k.clone(),
                expected: vec![],
                desired: v.clone(),
            },
            Request::Get { key: k.clone() },
            Request::Add {
                key: k.clone(),
                delta: -5,
            },
            Request::Check {
                keys: vec![k.clone(), b"/b".to_vec()],
            },
            Request::Wait {
                keys: vec![k.clone()],
            },
            Request::GetNumKeys,
            Request::DeleteKey { key: k.clone() },
            Request::Append {
                key: k.clone(),
                value: v.clone(),
            },
            Request::MultiGet {
                keys: vec![k.clone(), vec![]],
            },
            Request::MultiSet {
                pairs: vec![(k.clone(), v.clone()), (b"/c".to_vec(), vec![])],
            },
            Request::CancelWait,
            Request::Ping { nonce: 4242 },
            Request::QueuePush {
                key: k.clone(),
                value: v.clone(),
            },
            Request::QueuePop { key: k.clone() },
            Request::QueueLen { key: k.clone() },
            Request::ListKeys,
            Request::Barrier {
                key: k.clone(),
                world_size: 4,
            },
        ] {
            roundtrip(req);
        }
    }

    /// The scan agrees with `Request::parse` on every prefix, fed a byte at a time or at once.
    fn scan_agrees(buf: &[u8]) {
        let mut inc = FrameScan::default();
        for cut in 0..=buf.len() {
            let fresh = FrameScan::default().scan(&buf[..cut]);
            let resumed = inc.scan(&buf[..cut]);
            assert_eq!(fresh, resumed, "cut {cut}");
            match (Request::parse(&buf[..cut]), fresh) {
                (Ok(Parsed::Complete(_, a)), Ok(Scanned::Complete(b))) => assert_eq!(a, b),
                (Ok(Parsed::Incomplete { need: a }), Ok(Scanned::Incomplete { need: b })) => {
                    assert_eq!(a, b, "cut {cut}")
                }
                (Err(a), Err(b)) => assert_eq!(a, b),
                (p, s) => panic!("cut {cut}: parse {p:?}, scan {s:?}"),
            }
            if matches!(resumed, Ok(Scanned::Complete(_)) | Err(_)) {
                return;
            }
        }
    }

    #[test]
    fn the_scan_agrees_with_parse() {
        let k = b"/key".to_vec();
        for req in [
            Request::Validate { magic: 1 },
            Request::Set {
                key: k.clone(),
                value: vec![1, 2, 3],
            },
            Request::CompareSet {
                key: k.clone(),
                expected: vec![],
                desired: vec![9],
            },
            Request::Add {
                key: k.clone(),
                delta: 3,
            },
            Request::Check {
                keys: vec![k.clone(), vec![], b"/b".to_vec()],
            },
            Request::Wait { keys: vec![] },
            Request::MultiSet {
                pairs: vec![(k.clone(), vec![5; 20]), (vec![], vec![])],
            },
            Request::GetNumKeys,
            Request::Ping { nonce: 4 },
            Request::Barrier {
                key: k.clone(),
                world_size: 2,
            },
        ] {
            let mut buf = Vec::new();
            req.encode(&mut buf);
            buf.extend_from_slice(b"trailing");
            scan_agrees(&buf);
        }
        let mut bad = vec![Op::Check as u8];
        bad.extend_from_slice(&1u64.to_le_bytes());
        bad.extend_from_slice(&(MAX_KEY_LEN + 1).to_le_bytes());
        scan_agrees(&bad);
        scan_agrees(&[77]);
    }

    #[test]
    fn validate_bytes_match_torch() {
        let mut buf = Vec::new();
        Request::Validate {
            magic: VALIDATE_MAGIC,
        }
        .encode(&mut buf);
        assert_eq!(buf, [0x00, 0xce, 0xf7, 0x85, 0x3c]);
    }

    #[test]
    fn limits_are_enforced_before_the_bytes_arrive() {
        let mut buf = vec![Op::Get as u8];
        buf.extend_from_slice(&(MAX_KEY_LEN + 1).to_le_bytes());
        assert_eq!(
            Request::parse(&buf),
            Err(ProtocolError::KeyTooLong(MAX_KEY_LEN + 1))
        );

        let mut buf = vec![Op::Set as u8];
        put_bytes(&mut buf, b"/k");
        buf.extend_from_slice(&(MAX_VALUE_LEN + 1).to_le_bytes());
        assert_eq!(
            Request::parse(&buf),
            Err(ProtocolError::ValueTooLong(MAX_VALUE_LEN + 1))
        );

        let mut buf = vec![Op::Wait as u8];
        buf.extend_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(
            Request::parse(&buf),
            Err(ProtocolError::TooManyKeys(u64::MAX))
        );

        assert_eq!(Request::parse(&[99]), Err(ProtocolError::UnknownOpcode(99)));
    }

    #[test]
    fn many_maximal_values_hit_the_request_limit() {
        let mut buf = vec![Op::MultiSet as u8];
        buf.extend_from_slice(&MAX_KEYS.to_le_bytes());
        // Announce far more than MAX_REQUEST_LEN in values, sending only headers.
        let mut total = buf.len();
        let mut result = None;
        for _ in 0..100 {
            put_bytes(&mut buf, b"/k");
            buf.extend_from_slice(&MAX_VALUE_LEN.to_le_bytes());
            total += 18 + MAX_VALUE_LEN as usize;
            match Request::parse(&buf) {
                Ok(Parsed::Incomplete { need }) => assert!(need <= MAX_REQUEST_LEN),
                other => {
                    result = Some(other);
                    break;
                }
            }
            // Pretend the value arrived: pad with zeroes up to what was announced.
            buf.resize(total, 0);
        }
        assert!(
            matches!(result, Some(Err(ProtocolError::RequestTooLarge(_)))),
            "{result:?}"
        );
    }
}
