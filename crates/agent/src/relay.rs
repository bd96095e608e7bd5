//! Passing an agent process's output on (its stdout and stderr: its workers' prefixed lines,
//! or a whole subtree's or srun step's), on the launch host and in an inner agent of the
//! launch tree; and, on the launch host, reading the marks each agent writes behind a step's
//! output ([`Marks`]), so that a step's result is taken only once every line of it is out.
//!
//! One writer thread puts the lines on this process's console: a relay task hands it each line
//! whole (never two nodes' lines mixed) and waits when it is behind, so a slow console holds up
//! the agents' pipes (and their workers), never the store, which shares the runtime with the
//! relays. A mark or a pipe's end is recorded by that thread after the lines before it were
//! written: "arrived" means on the console.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, OnceLock};

use tokio::io::AsyncBufReadExt as _;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

/// What one agent's pipe is read from.
pub type Reader = Box<dyn tokio::io::AsyncRead + Send + Unpin>;

/// Lines of an agent's stderr kept to explain why it failed.
pub const TAIL_LINES: usize = 10;

/// Bytes read at a time from an agent's stdout and stderr: small, two per node (8 KiB each
/// were a third of the launch host's memory at a thousand nodes); longer lines still come
/// through whole.
const RELAY_BUFFER: usize = 2048;

/// The longest line passed on whole: an agent's lines are at most a worker's longest
/// ([`nrun_node::output::MAX_LINE`]) with its prefix; anything longer is passed on in pieces
/// of this size, so a relay's memory stays bounded whatever comes.
const RELAY_LINE: usize = nrun_node::output::MAX_LINE + 4096;

/// The marks that came through one agent process's pipes: for each node it serves (one, an
/// srun step's many, an inner agent's subtree), the steps whose output ended on stdout and on
/// stderr, and whether each pipe ended.
pub struct Marks {
    token: String,
    /// Whom to nudge when a mark arrives (the session waits for it).
    nudges: Option<Arc<Nudges>>,
    seen: Mutex<Seen>,
}

impl Marks {
    pub fn new(token: String, nudges: Option<Arc<Nudges>>) -> Marks {
        Marks {
            token,
            nudges,
            seen: Mutex::default(),
        }
    }
}

#[derive(Default)]
struct Seen {
    /// Per node: one past the last step marked, on stdout and on stderr.
    next: std::collections::HashMap<usize, [usize; 2]>,
    /// Each pipe ended (nothing more can come).
    closed: [bool; 2],
    /// When a line last came through a pipe.
    moved: Option<std::time::Instant>,
    /// Relays of these pipes waiting for this host's console to take a line.
    waiting: usize,
}

/// Whether a node's output of a step has reached this host.
#[derive(Debug, PartialEq, Eq)]
pub enum Delivery {
    /// Every line of it is on this host's console: both marks came.
    Arrived,
    /// Not yet: `console`, this host's console is behind (the relay waits for it); else the
    /// pipes last moved at `moved` (None: never).
    Pending {
        console: bool,
        moved: Option<std::time::Instant>,
    },
    /// It cannot come: this pipe (stdout, stderr) ended before its mark.
    Cut(&'static str),
}

impl Marks {
    /// A line came through; `waiting`: its relay now waits for the console (+1) or no
    /// longer does (-1).
    fn moved(&self, waiting: isize) {
        let mut s = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        s.moved = Some(std::time::Instant::now());
        s.waiting = s.waiting.saturating_add_signed(waiting);
    }

    fn saw(&self, stream: Stream, node: usize, no: usize) {
        {
            let mut s = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            let next = &mut s.next.entry(node).or_default()[stream as usize];
            *next = (*next).max(no + 1);
        }
        if let Some(n) = &self.nudges {
            n.nudge(node);
        }
    }

    fn closed(&self, stream: Stream) {
        let nodes: Vec<usize> = {
            let mut s = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            s.closed[stream as usize] = true;
            s.next.keys().copied().collect()
        };
        if let Some(n) = &self.nudges {
            nodes.into_iter().for_each(|i| n.nudge(i));
        }
    }

    /// Where node `node`'s output of step `no` is.
    pub fn delivery(&self, node: usize, no: usize) -> Delivery {
        let s = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let next = s.next.get(&node).copied().unwrap_or_default();
        for (stream, name) in [(Stream::Out, "stdout"), (Stream::Err, "stderr")] {
            let i = stream as usize;
            if next[i] <= no {
                return match s.closed[i] {
                    true => Delivery::Cut(name),
                    false => Delivery::Pending {
                        console: s.waiting > 0,
                        moved: s.moved,
                    },
                };
            }
        }
        Delivery::Arrived
    }
}

pub use nrun_node::output::{Stream, console_write};

/// How one of an agent's pipes is passed on.
pub(crate) struct Passing {
    pub stream: Stream,
    pub marks: Option<Arc<Marks>>,
    /// Its own lines (nrun's, ssh's) on stderr go on as "TAG: line".
    pub tag: Option<String>,
    /// Its last lines, kept (stderr: the agent's last words).
    pub tail: Option<Arc<Mutex<VecDeque<String>>>>,
}

impl Passing {
    /// Copies the pipe to this process's own stream a line at a time (bytes as they are, not
    /// only UTF-8), taking the output marks it reads out; records the pipe's end.
    pub(crate) async fn relay(self, pipe: Reader) {
        use tokio::io::AsyncReadExt as _;
        let mut r = tokio::io::BufReader::with_capacity(RELAY_BUFFER, pipe);
        loop {
            let mut buf = Vec::with_capacity(256);
            match (&mut r)
                .take(RELAY_LINE as u64)
                .read_until(b'\n', &mut buf)
                .await
            {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            if buf.last() != Some(&b'\n') {
                buf.push(b'\n');
            }
            // While the console is behind, the link is not what holds up the marks.
            if let Some(m) = &self.marks {
                m.moved(1);
            }
            self.line(buf).await;
            if let Some(m) = &self.marks {
                m.moved(-1);
            }
        }
        if let Some(m) = &self.marks {
            put(Item::Closed(m.clone(), self.stream)).await;
        }
    }

    async fn line(&self, mut buf: Vec<u8>) {
        if let Some(m) = &self.marks
            && let Some((at, node, no)) = find_mark(&buf, &m.token)
        {
            // A mark is written whole, after a whole line; but srun passes its nodes'
            // output on in pieces as they come, so another node's long line may be cut
            // by it: the part before it is passed on unended, and that line's rest
            // follows.
            buf.truncate(at);
            if !buf.is_empty() {
                put(Item::Bytes(self.stream, buf, None)).await;
            }
            put(Item::Mark(m.clone(), self.stream, node, no)).await;
            return;
        }
        let text = String::from_utf8_lossy(&buf[..buf.len() - 1]).into_owned();
        // Whose line it is matters for the journal's sign of work (a worker's, not an agent's,
        // ssh's or srun's own), looked for until the first, and for a tagged stream.
        let own = (nrun_base::activity::wanted() || self.tag.is_some()) && own_line(&text);
        if !own {
            nrun_base::activity::line();
        }
        if let Some(tail) = &self.tail {
            let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
            if t.len() == TAIL_LINES {
                t.pop_front();
            }
            t.push_back(text.clone());
        }
        let buf = match &self.tag {
            // A child's own words, passed up the tree, named by their node: the launch host
            // takes its inner agent's unnamed nrun and ssh lines as that agent's last words (a
            // child's are not).
            Some(t) if self.stream == Stream::Err && own => format!("{t}: {text}\n").into_bytes(),
            _ => buf,
        };
        put(Item::Bytes(self.stream, buf, None)).await;
    }
}

/// Where a mark with `token` starts in the line `buf` ('\n'-ended), and its node and step.
fn find_mark(buf: &[u8], token: &str) -> Option<(usize, usize, usize)> {
    let mark = nrun_proto::protocol::OUTPUT_MARK.as_bytes();
    let body = &buf[..buf.len() - 1];
    // Its first byte, a control character, starts the search (a line is searched once).
    let at = body
        .iter()
        .enumerate()
        .filter(|&(_, &b)| b == mark[0])
        .map(|(i, _)| i)
        .find(|&i| body[i..].starts_with(mark))?;
    let tail = std::str::from_utf8(&body[at..]).ok()?;
    let (node, no) = nrun_proto::protocol::read_output_mark(tail, token)?;
    Some((at, node, no))
}

/// A line nrun itself (the agent: its lines start with "nrun"), ssh or srun wrote, not one of
/// the workers'.
pub(crate) fn own_line(l: &str) -> bool {
    let l = l.trim_start();
    ["nrun", "ssh:", "srun:", "Connection to "]
        .iter()
        .any(|p| l.starts_with(p))
}

/// Bytes waiting for the console writer at most, all relays together.
const QUEUED: usize = 4 * RELAY_LINE;

/// What the console writer does, in the order the relays handed it over.
enum Item {
    Bytes(Stream, Vec<u8>, Option<OwnedSemaphorePermit>),
    /// A step's output of a node ended on this stream (all before it is written).
    Mark(Arc<Marks>, Stream, usize, usize),
    /// A pipe ended.
    Closed(Arc<Marks>, Stream),
}

struct Console {
    tx: mpsc::Sender<Item>,
    budget: Arc<Semaphore>,
}

/// The console writer, started with the first line.
fn console() -> &'static Console {
    static CONSOLE: OnceLock<Console> = OnceLock::new();
    CONSOLE.get_or_init(|| {
        let (tx, mut rx) = mpsc::channel::<Item>(1024);
        let started = std::thread::Builder::new()
            .name("nrun-relay".into())
            .spawn(move || {
                while let Some(item) = rx.blocking_recv() {
                    match item {
                        // A closed console is told once (the launcher then stops the job).
                        Item::Bytes(stream, b, _held) => console_write(stream, &b, false),
                        Item::Mark(m, stream, node, no) => {
                            if stream == Stream::Out {
                                console_write(Stream::Out, b"", true);
                            }
                            m.saw(stream, node, no);
                        }
                        Item::Closed(m, stream) => m.closed(stream),
                    }
                }
            });
        if let Err(e) = started {
            // Never seen: the lines then go nowhere, and no mark arrives (the session says so).
            tracing::warn!("cannot start the thread that writes the agents' output: {e}");
        }
        Console {
            tx,
            budget: Arc::new(Semaphore::new(QUEUED)),
        }
    })
}

/// Hands `item` to the console writer, waiting while it is behind.
async fn put(item: Item) {
    let c = console();
    let item = match item {
        Item::Bytes(s, b, None) => {
            let n = b.len().min(QUEUED) as u32;
            Item::Bytes(s, b, c.budget.clone().acquire_many_owned(n).await.ok())
        }
        other => other,
    };
    let _ = c.tx.send(item).await;
}

/// Nodes a link asks the session to look at again (its agent's process ended), and the wake-up
/// that goes with them: with the store's changed keys, what lets the session look at the nodes
/// that changed instead of at every node on every event.
#[derive(Default)]
pub struct Nudges {
    nodes: std::sync::Mutex<Vec<usize>>,
    pub notify: tokio::sync::Notify,
}

impl Nudges {
    pub fn nudge(&self, node: usize) {
        self.nodes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(node);
        self.notify.notify_one();
    }

    pub fn take(&self) -> Vec<usize> {
        std::mem::take(&mut *self.nodes.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_arrives_with_both_marks_and_is_cut_by_a_pipe_that_ended_first() {
        let m = Marks::new("tok".into(), None);
        let quiet = Delivery::Pending {
            console: false,
            moved: None,
        };
        assert_eq!(m.delivery(2, 0), quiet);
        m.saw(Stream::Out, 2, 0);
        assert_eq!(m.delivery(2, 0), quiet);
        m.saw(Stream::Err, 2, 0);
        assert_eq!(m.delivery(2, 0), Delivery::Arrived);
        // A later mark covers the earlier steps; another node's is its own.
        m.saw(Stream::Out, 2, 3);
        m.saw(Stream::Err, 2, 3);
        assert_eq!(m.delivery(2, 1), Delivery::Arrived);
        assert_eq!(m.delivery(1, 0), quiet);
        m.moved(1);
        assert!(matches!(
            m.delivery(1, 0),
            Delivery::Pending {
                console: true,
                moved: Some(_)
            }
        ));
        m.moved(-1);
        m.closed(Stream::Err);
        // stdout may still bring it.
        assert!(matches!(
            m.delivery(1, 0),
            Delivery::Pending {
                console: false,
                moved: Some(_)
            }
        ));
        m.closed(Stream::Out);
        assert_eq!(m.delivery(1, 0), Delivery::Cut("stdout"));
        assert_eq!(m.delivery(2, 3), Delivery::Arrived);
    }

    #[test]
    fn a_mark_is_found_alone_or_behind_another_nodes_unended_piece() {
        let mark = nrun_proto::protocol::output_mark("tok", 4, 9);
        assert_eq!(find_mark(mark.as_bytes(), "tok"), Some((0, 4, 9)));
        let glued = format!("[h1:rank0]: half a li{mark}");
        assert_eq!(find_mark(glued.as_bytes(), "tok"), Some((21, 4, 9)));
        assert_eq!(find_mark(mark.as_bytes(), "other"), None);
        assert_eq!(find_mark(b"\x01 a worker's control byte\n", "tok"), None);
    }
}
