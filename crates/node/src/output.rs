//! Worker output: pumps read each worker's pipes line by line, and one writer thread puts the
//! lines on the console (with a rank prefix) and into the per-rank log files; it starts with
//! the first line.
//!
//! A line ends at '\n'; a segment ending at '\r' (a progress bar redrawing itself) and the
//! start of a line that stays unfinished for a moment (a prompt such as pdb's) are passed on as
//! they come, so the console shows them live. Files get the bytes as written.
//!
//! One writer means lines of different ranks never interleave mid-line: a rank's unfinished
//! line is ended before another rank's output goes out. It is a plain thread fed
//! by a bounded channel, so a slow terminal slows the workers' pipes (back-pressure), never the
//! store, which shares the async runtime with the pumps.

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::mpsc;

/// Longest line passed on whole (1 MiB, docs/torchrun.md, "Output"): a longer run of bytes without a
/// newline is cut into pieces of this size, each ended with [`CUT_MARK`], so the memory a
/// worker's output holds stays bounded.
pub const MAX_LINE: usize = 1024 * 1024;
/// What ends each piece of a line cut at [`MAX_LINE`], visibly.
pub(crate) const CUT_MARK: &[u8] = b" [nrun: line longer than 1 MiB, continued on the next line]\n";
/// The start of a line shown before its end comes (a prompt) is at most this long; a longer
/// one is a long line being written, and waits for its end.
const PROMPT_MAX: usize = 4096;
/// What the pump's buffer shrinks back to after a long line.
const BUF_KEPT: usize = 8192;
/// Lines of stderr kept per worker for the failure summary.
pub const TAIL_LINES: usize = 20;
/// Bytes of each of them kept.
const TAIL_LINE_MAX: usize = 4096;
/// How long the start of a line may wait for its end before it is shown on its own.
const PARTIAL_AFTER: std::time::Duration = std::time::Duration::from_millis(50);

/// Whether rank prefixes are coloured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Color {
    /// On a terminal.
    #[default]
    Auto,
    Always,
    Never,
}

/// The size of a terminal a worker writes to instead of a pipe: where nrun's own stream is
/// a terminal (and no log file takes the stream), each worker gets a pseudo-terminal of its
/// size, less the rank prefix, so that what checks for a terminal (tqdm's width, rich's and
/// Python's colours, `isatty`) sees one, as torchrun's workers see the terminal itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Tty {
    pub cols: u16,
    pub rows: u16,
}

impl Tty {
    /// This process's `stream`, if it is a terminal: its size (0 x 0 where it tells none),
    /// `prefix` columns narrower.
    pub fn of_console(stream: Stream, prefix: &str) -> Option<Tty> {
        Some(console_size(stream)?.less(prefix))
    }

    /// This size `prefix` columns narrower.
    pub fn less(self, prefix: &str) -> Tty {
        let prefix = u16::try_from(prefix.chars().count()).unwrap_or(u16::MAX);
        Tty {
            // A terminal of unknown width stays unknown (0), not 1.
            cols: match self.cols {
                0 => 0,
                c => c.saturating_sub(prefix).max(1),
            },
            rows: self.rows,
        }
    }

    /// The size of the terminal `fd` is (either side).
    pub(crate) fn of(fd: impl std::os::fd::AsFd) -> Option<Tty> {
        use std::os::fd::AsRawFd as _;
        // SAFETY: winsize is a plain C struct, valid all zeroes.
        let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
        let fd = fd.as_fd().as_raw_fd();
        // SAFETY: TIOCGWINSZ fills a local plain struct from a descriptor the caller holds.
        (unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) } == 0).then_some(Tty {
            cols: ws.ws_col,
            rows: ws.ws_row,
        })
    }

    /// Makes this the size of the terminal whose master side is `master`.
    pub(crate) fn set(self, master: &impl std::os::fd::AsRawFd) -> std::io::Result<()> {
        let ws = libc::winsize {
            ws_col: self.cols,
            ws_row: self.rows,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCSWINSZ reads `ws`, a plain struct, on a descriptor the caller holds open.
        match unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &ws) } {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        }
    }
}

/// The sizes of this process's stdout and stderr, where they are terminals.
pub fn console_sizes() -> [Option<Tty>; 2] {
    [Stream::Out, Stream::Err].map(console_size)
}

/// The launcher's terminal's sizes as it told this agent last (whose own outputs are pipes).
static TOLD: Mutex<Option<[Option<Tty>; 2]>> = Mutex::new(None);

/// An agent is told the launcher's terminal's sizes: its workers' terminals follow them.
pub fn tell_console(sizes: [Option<Tty>; 2]) {
    *TOLD.lock().unwrap_or_else(|e| e.into_inner()) = Some(sizes);
}

/// The terminal the workers' terminals follow: the launcher's as told, else this process's.
pub(crate) fn followed_console() -> [Option<Tty>; 2] {
    TOLD.lock()
        .unwrap_or_else(|e| e.into_inner())
        .unwrap_or_else(console_sizes)
}

/// The size of this process's `stream`, if it is a terminal (0 x 0 where it tells none).
fn console_size(stream: Stream) -> Option<Tty> {
    use std::io::IsTerminal as _;
    let size = match stream {
        Stream::Out if std::io::stdout().is_terminal() => Tty::of(std::io::stdout()),
        Stream::Err if std::io::stderr().is_terminal() => Tty::of(std::io::stderr()),
        _ => return None,
    };
    Some(size.unwrap_or(Tty { cols: 0, rows: 0 }))
}

/// When the workers' terminal may have been resized: SIGWINCH, and a look once a second
/// besides, since a worker holding the terminal's foreground (rank 0 reading stdin) gets the
/// terminal's SIGWINCH and nrun does not, and an agent hears of the launcher's terminal from
/// the launcher.
pub struct Resizes {
    winch: Option<tokio::signal::unix::Signal>,
    tick: tokio::time::Interval,
}

impl Resizes {
    /// Needs the runtime (the timer and the signal's handler).
    pub fn start() -> Resizes {
        use tokio::signal::unix::{SignalKind, signal};
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Resizes {
            // Without the handler the look once a second still follows.
            winch: signal(SignalKind::window_change()).ok(),
            tick,
        }
    }

    /// The next SIGWINCH or look; never where there is nothing to watch (`None`).
    pub async fn next(me: &mut Option<Resizes>) {
        let Some(r) = me else {
            return std::future::pending().await;
        };
        let winch = async {
            let heard = match &mut r.winch {
                Some(w) => w.recv().await.is_some(),
                None => false,
            };
            if !heard {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            () = winch => {}
            _ = r.tick.tick() => {}
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    Out = 0,
    Err = 1,
}

/// Where one stream of one worker goes.
#[derive(Default)]
pub struct Sink {
    pub console: bool,
    pub file: Option<File>,
    /// The file's path, to name it when a write fails.
    pub path: Option<std::path::PathBuf>,
}

impl Sink {
    /// Writes `data` to the log file. A write that fails (a full disk, an I/O error) is said
    /// once; the file is given up and the console takes this stream's output from then on,
    /// so nothing more is lost. Returns whether this write failed.
    fn log(&mut self, data: &[u8], rank: usize) -> bool {
        let Some(f) = &mut self.file else {
            return false;
        };
        let Err(e) = f.write_all(data) else {
            return false;
        };
        let path = self
            .path
            .as_ref()
            .map_or("its log file".into(), |p| p.display().to_string());
        tracing::warn!(
            "rank {rank}: cannot write {path} ({e}); its output goes to the console from here \
             on, and what was not written is lost from the file"
        );
        self.file = None;
        self.console = true;
        true
    }
}

/// One worker's output settings.
pub struct WorkerOutput {
    pub rank: usize,
    /// e.g. "[rank3]: "; empty when there is a single worker.
    pub prefix: String,
    /// Colour index for the prefix on a terminal.
    pub colour: usize,
    pub color: Color,
    pub sinks: [Sink; 2],
    /// `--progress-regex`: a line of this worker's output (either stream) that matches is one
    /// unit of progress; its first capture group, read as a number, a step.
    pub progress: Option<regex::Regex>,
}

/// What a group's output showed of its progress (`--progress-regex`), read by its writer from
/// every line, on the console or not: the most matching lines of one worker, and the highest
/// step a match named (none: no match named one).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Progress {
    pub marks: u64,
    pub step: Option<u64>,
}

/// The writer's count towards [`Progress`]: per worker, its matching lines.
#[derive(Default)]
struct Tally {
    marks: Vec<u64>,
    step: Option<u64>,
}

impl Tally {
    /// Counts `line` of worker `idx` if it matches `re`.
    fn line(&mut self, idx: usize, re: &regex::Regex, line: &[u8]) {
        let text = String::from_utf8_lossy(line);
        let Some(c) = re.captures(text.trim_end_matches(['\n', '\r'])) else {
            return;
        };
        if self.marks.len() <= idx {
            self.marks.resize(idx + 1, 0);
        }
        self.marks[idx] += 1;
        let step = c
            .iter()
            .skip(1)
            .flatten()
            .next()
            .and_then(|m| m.as_str().trim().parse::<u64>().ok());
        self.step = self.step.max(step);
    }

    fn progress(&self) -> Progress {
        Progress {
            marks: self.marks.iter().copied().max().unwrap_or(0),
            step: self.step,
        }
    }
}

pub(crate) enum Msg {
    Line {
        worker: usize,
        stream: Stream,
        data: Vec<u8>,
        /// Its bytes' share of [`BUFFERED`], given back once it is written.
        _held: Option<tokio::sync::OwnedSemaphorePermit>,
    },
}

/// Bytes of a group's output waiting for the writer at most: a slow console holds up the
/// workers (their pipes fill) rather than nrun's memory, however long their lines.
const BUFFERED: usize = 16 * MAX_LINE;

/// `line` without the "[rank<rank>]: " that torch's distributed excepthook puts before every
/// line of an uncaught exception (distributed_c10d.py, `_distributed_excepthook`), or the
/// "[rank<rank>]:" before its C++ log lines' "[E...]"; a line with another rank's prefix, or
/// none, is left as it is.
fn strip_torch_prefix(line: &[u8], rank: usize) -> &[u8] {
    let Some(rest) = line.strip_prefix(b"[rank") else {
        return line;
    };
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    let ours = std::str::from_utf8(&rest[..digits])
        .ok()
        .and_then(|d| d.parse::<usize>().ok())
        == Some(rank);
    let after = &rest[digits..];
    match after.strip_prefix(b"]: ") {
        Some(body) if ours => body,
        // torch's C++ log lines: "[rank1]:[E1201 14:53:58.470 ProcessGroupNCCL.cpp:1628] ...".
        _ if ours && after.starts_with(b"]:[") => &after[2..],
        _ => line,
    }
}

/// Last lines of a worker's stderr, kept for the failure summary.
pub(crate) type Tail = Arc<Mutex<VecDeque<String>>>;

pub struct Output {
    lines: Lines,
    /// Some worker's lines are matched for progress.
    progress: bool,
}

/// Where the pumps send: the writer's channel, and the writer's thread, started with the first
/// line (a group whose workers print nothing costs no thread).
#[derive(Clone)]
pub struct Lines {
    tx: mpsc::Sender<Msg>,
    budget: Arc<tokio::sync::Semaphore>,
    writer: Arc<Mutex<Writer>>,
}

enum Writer {
    /// No line yet: what the thread takes when it starts.
    Waiting(mpsc::Receiver<Msg>, Vec<WorkerOutput>),
    Running(JoinHandle<Tally>),
    /// Joined, or its thread could not start (never seen): the lines go nowhere rather than
    /// stop the job.
    Gone,
}

impl Output {
    pub fn start(workers: Vec<WorkerOutput>) -> Output {
        let (tx, rx) = mpsc::channel::<Msg>(1024);
        let progress = workers.iter().any(|w| w.progress.is_some());
        let writer = Arc::new(Mutex::new(Writer::Waiting(rx, workers)));
        Output {
            progress,
            lines: Lines {
                tx,
                writer,
                budget: Arc::new(tokio::sync::Semaphore::new(BUFFERED)),
            },
        }
    }

    pub fn sender(&self) -> Lines {
        self.lines.clone()
    }

    /// Waits until every line sent so far is written. Pumps hold their own senders: finish
    /// them first. Returns what the lines showed of progress, where a worker has
    /// `--progress-regex` (no line at all: none matched).
    pub fn finish(self) -> Option<Progress> {
        let Lines { tx, writer, .. } = self.lines;
        drop(tx);
        let state = writer
            .lock()
            .map(|mut w| std::mem::replace(&mut *w, Writer::Gone));
        match state {
            Ok(Writer::Running(t)) => {
                let tally = t.join().unwrap_or_default();
                self.progress.then(|| tally.progress())
            }
            _ => self.progress.then(Progress::default),
        }
    }
}

impl Lines {
    async fn send(&self, msg: Msg) {
        if let Ok(mut w) = self.writer.lock() {
            *w = match std::mem::replace(&mut *w, Writer::Gone) {
                Writer::Waiting(rx, workers) => std::thread::Builder::new()
                    .name("nrun-output".into())
                    .spawn(move || write_lines(rx, workers))
                    .map_or(Writer::Gone, Writer::Running),
                started => started,
            };
        }
        let _ = self.tx.send(msg).await;
    }
}

/// The writer's thread: each line to its console stream (prefixed) and its log file.
fn write_lines(mut rx: mpsc::Receiver<Msg>, mut workers: Vec<WorkerOutput>) -> Tally {
    let mut tally = Tally::default();
    let colour = [colours(Stream::Out), colours(Stream::Err)];
    let mut line = Vec::with_capacity(256);
    // The console line left unfinished: whose, on which stream, and whether it
    // ended at '\r' (the cursor is back at its start) or mid-line.
    let mut open: Option<(usize, Stream, bool)> = None;
    // Log files given up on a failed write.
    let mut lost = 0;
    let write = console_write;
    while let Some(Msg::Line {
        worker,
        stream,
        data,
        _held,
    }) = rx.blocking_recv()
    {
        let Some(w) = workers.get_mut(worker) else {
            continue;
        };
        // A line (to the console or a log file) is the launch host's sign of work.
        nrun_base::activity::line();
        if let Some(re) = &w.progress {
            tally.line(worker, re, &data);
        }
        let sink = &mut w.sinks[stream as usize];
        lost += usize::from(sink.log(&data, w.rank));
        if !sink.console {
            continue;
        }
        let mut continues = false;
        if let Some((ow, os, cr)) = open.take() {
            if (ow, os) == (worker, stream) {
                continues = !cr;
            } else {
                write(os, b"\n", true);
            }
        }
        line.clear();
        let mut body = &data[..];
        if !w.prefix.is_empty() && !continues {
            // torch's excepthook (init_process_group's) already starts each line
            // of an uncaught exception with "[rankN]: ": ours replaces it, so the
            // rank is said once (`[rank1]: Traceback`, as torchrun shows it).
            body = strip_torch_prefix(body, w.rank);
            let coloured = match w.color {
                Color::Always => true,
                Color::Never => false,
                Color::Auto => colour[stream as usize],
            };
            if coloured {
                let c = COLOURS[w.colour % COLOURS.len()].on_default();
                let _ = write!(line, "{c}{}{c:#}", w.prefix);
            } else {
                line.extend_from_slice(w.prefix.as_bytes());
            }
        }
        line.extend_from_slice(body);
        let end = data.last().copied();
        if end != Some(b'\n') {
            open = Some((worker, stream, end == Some(b'\r')));
        }
        write(stream, &line, open.is_some());
    }
    if let Some((_, os, _)) = open {
        write(os, b"\n", true);
    }
    let _ = std::io::stdout().flush();
    if lost > 0 {
        tracing::warn!(
            "on {}: {lost} log file(s) of this group are incomplete: writing them \
             failed (see above; check the --log-dir filesystem's free space); their \
             output after the failure went to the console",
            nrun_base::net::hostname()
        );
    }
    tally
}

const COLOURS: [anstyle::AnsiColor; 6] = {
    use anstyle::AnsiColor::*;
    [Cyan, Green, Yellow, Magenta, Blue, Red]
};

/// Whether `--color auto` colours what goes to this process's `stream`: a terminal, unless
/// NO_COLOR, CLICOLOR=0 or TERM=dumb say otherwise; CLICOLOR_FORCE colours a pipe too
/// (anstream's reading of those conventions).
pub fn colours(stream: Stream) -> bool {
    let choice = match stream {
        Stream::Out => anstream::AutoStream::choice(&std::io::stdout()),
        Stream::Err => anstream::AutoStream::choice(&std::io::stderr()),
    };
    choice != anstream::ColorChoice::Never
}

/// Writes worker output to this process's own stdout or stderr (`flush`: stdout now, for a
/// line left open). A write error does not stop the writer; a closed pipe (the reader of
/// `nrun ... | head` exited) is told once to whoever asked with [`on_console_closed`].
pub fn console_write(stream: Stream, b: &[u8], flush: bool) {
    let r = match stream {
        Stream::Out => {
            let mut o = std::io::stdout().lock();
            o.write_all(b)
                .and_then(|()| if flush { o.flush() } else { Ok(()) })
        }
        Stream::Err => std::io::stderr().lock().write_all(b),
    };
    if r.is_err_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe) {
        console_closed(stream);
    }
}

/// Who is told that the console's pipe closed: the launcher's signal stream, which stops the
/// job as if nrun had got SIGPIPE (a worker writing to a closed pipe itself would have, or
/// BrokenPipeError: how torchrun's job ends there). An agent registers nobody: its stdout
/// is its coordinator's pipe, whose loss is told otherwise.
static CLOSED_TELLS: Mutex<Option<tokio::sync::mpsc::UnboundedSender<crate::Caught>>> =
    Mutex::new(None);
static CLOSED_TOLD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// From now on, a console pipe found closed sends [`crate::Caught::Stop`]`(SIGPIPE)` on `tx`.
pub(crate) fn on_console_closed(tx: tokio::sync::mpsc::UnboundedSender<crate::Caught>) {
    *CLOSED_TELLS.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
}

fn console_closed(stream: Stream) {
    let tells = CLOSED_TELLS.lock().unwrap_or_else(|e| e.into_inner());
    let Some(tx) = tells.as_ref() else { return };
    if CLOSED_TOLD.swap(true, std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    // Told before it is said: stderr may be the closed pipe too (`2>&1 | head`).
    let _ = tx.send(crate::Caught::Stop(libc::SIGPIPE));
    let which = match stream {
        Stream::Out => "stdout",
        Stream::Err => "stderr",
    };
    tracing::warn!(
        "{which} is a pipe whose reader exited (`nrun ... | head`): stopping the job, exit {} \
         (SIGPIPE), as torchrun's ends when its workers write there; to keep a job running, \
         send its output to a file or use --redirects",
        nrun_base::error::exit::signal(libc::SIGPIPE)
    );
}

/// Copies one pipe to the writer a line at a time ('\n'), a progress segment at a time ('\r'),
/// and the start of a line that waits longer than [`PARTIAL_AFTER`] for its end; the last
/// lines go to `tail`.
pub async fn pump(
    mut pipe: impl AsyncRead + Unpin,
    worker: usize,
    stream: Stream,
    tx: Lines,
    tail: Option<Tail>,
) {
    let mut buf: Vec<u8> = Vec::with_capacity(8192);
    let mut chunk = vec![0u8; 16384];
    let mut t = TailLine::new(tail);
    loop {
        let read = pipe.read(&mut chunk);
        // A long line is not shown in parts while it is being written: only a short start
        // waiting for its end (a prompt) is.
        let n = if buf.is_empty() || buf.len() > PROMPT_MAX {
            read.await.unwrap_or(0)
        } else {
            match tokio::time::timeout(PARTIAL_AFTER, read).await {
                Ok(r) => r.unwrap_or(0),
                Err(_) => {
                    // Nothing more for a while: show what there is (a prompt).
                    let part = std::mem::take(&mut buf);
                    emit(&tx, worker, stream, &mut t, part).await;
                    continue;
                }
            }
        };
        if n == 0 {
            if !buf.is_empty() {
                buf.push(b'\n');
                emit(&tx, worker, stream, &mut t, std::mem::take(&mut buf)).await;
            }
            return;
        }
        // Only the new bytes are searched (and a '\r' left at the end, which a '\n' may follow):
        // a long line comes in many reads.
        let mut scan = buf.len().saturating_sub(1);
        buf.extend_from_slice(&chunk[..n]);
        let mut start = 0;
        while let Some(i) = buf[scan..].iter().position(|&b| b == b'\n' || b == b'\r') {
            let mut end = scan + i + 1;
            if buf[end - 1] == b'\r' {
                match buf.get(end) {
                    // "\r\n" ends one line.
                    Some(b'\n') => end += 1,
                    Some(_) => {}
                    // A '\n' may follow in the next read.
                    None => break,
                }
            }
            emit(&tx, worker, stream, &mut t, buf[start..end].to_vec()).await;
            start = end;
            scan = end;
        }
        buf.drain(..start);
        while buf.len() >= MAX_LINE {
            let mut part: Vec<u8> = buf.drain(..MAX_LINE).collect();
            part.extend_from_slice(CUT_MARK);
            emit(&tx, worker, stream, &mut t, part).await;
        }
        if buf.is_empty() && buf.capacity() > BUF_KEPT {
            buf = Vec::with_capacity(BUF_KEPT);
        }
    }
}

/// The line being built for the tail: a '\r' starts it over (only a progress bar's last state
/// is kept), a '\n' keeps it.
struct TailLine {
    tail: Option<Tail>,
    line: Vec<u8>,
}

impl TailLine {
    /// The start of a long line is enough for the failure summary: a tail of 1 MiB lines
    /// would hold 20 MiB per worker.
    fn extend(&mut self, seg: &[u8]) {
        let room = TAIL_LINE_MAX.saturating_sub(self.line.len());
        self.line.extend_from_slice(&seg[..seg.len().min(room)]);
    }

    fn new(tail: Option<Tail>) -> TailLine {
        TailLine {
            tail,
            line: Vec::new(),
        }
    }

    fn add(&mut self, seg: &[u8]) {
        if self.tail.is_none() {
            return;
        }
        match seg.last() {
            Some(b'\n') => {
                self.extend(seg);
                // Without colour codes (a worker on a terminal colours its traceback): the
                // summary and the JSON report quote it as text.
                let line = String::from_utf8_lossy(&self.line);
                let mut text = match self.line.contains(&0x1b) {
                    true => anstream::adapter::strip_str(&line).to_string(),
                    false => line.into_owned(),
                };
                text.truncate(text.trim_end().len());
                self.line.clear();
                let Some(t) = &self.tail else { return };
                let mut t = t.lock().unwrap_or_else(|e| e.into_inner());
                if t.len() == TAIL_LINES {
                    t.pop_front();
                }
                t.push_back(text);
            }
            Some(b'\r') => {
                self.line.clear();
                self.extend(&seg[..seg.len() - 1]);
            }
            _ => self.extend(seg),
        }
    }
}

/// One segment to the writer, and to the tail.
async fn emit(tx: &Lines, worker: usize, stream: Stream, tail: &mut TailLine, data: Vec<u8>) {
    tail.add(&data);
    let held = (tx.budget.clone())
        .acquire_many_owned(data.len().min(BUFFERED) as u32)
        .await
        .ok();
    tx.send(Msg::Line {
        worker,
        stream,
        data,
        _held: held,
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::{Progress, TailLine, Tally, strip_torch_prefix};

    /// `--progress-regex`: each matching line counts for its worker, the group's figure is the
    /// most of one worker, and the first capture group that matched, read as a number, is a
    /// step (the highest wins; a capture that is no number counts the line only).
    #[test]
    fn progress_counts_matching_lines_and_the_highest_step() {
        let step = regex::Regex::new(r"step (\d+)|epoch (\w+)").unwrap();
        let mut t = Tally::default();
        for (w, line) in [
            (0, "step 3\n"),
            (1, "loss 0.5\n"),
            (1, "[rank1]: step 7\r"),
            (0, "step 4\n"),
            (0, "epoch two\n"),
        ] {
            t.line(w, &step, line.as_bytes());
        }
        assert_eq!(
            t.progress(),
            Progress {
                marks: 3,
                step: Some(7)
            }
        );
        let plain = regex::Regex::new("iteration done").unwrap();
        let mut t = Tally::default();
        t.line(2, &plain, b"iteration done\n");
        t.line(2, &plain, b"nothing\n");
        assert_eq!(
            t.progress(),
            Progress {
                marks: 1,
                step: None
            }
        );
        assert_eq!(Tally::default().progress(), Progress::default());
    }

    /// The failure summary's tail is text: a coloured traceback line (a worker on a
    /// terminal) is kept without its colour codes.
    #[test]
    fn the_tail_is_plain_text() {
        let tail = super::Tail::default();
        let mut t = TailLine::new(Some(tail.clone()));
        t.add(b"\x1b[1;35mValueError\x1b[0m: \x1b[35mbad\x1b[0m\n");
        t.add(b"plain\n");
        let got: Vec<String> = tail.lock().unwrap().iter().cloned().collect();
        assert_eq!(got, ["ValueError: bad", "plain"]);
    }

    #[test]
    fn torchs_own_rank_prefix_is_said_once() {
        assert_eq!(
            strip_torch_prefix(b"[rank1]: Traceback (most recent call last):\n", 1),
            b"Traceback (most recent call last):\n"
        );
        // Another rank's, a prefix without its ": ", or none: the line as it is.
        for (line, rank) in [
            (&b"[rank12]: x\n"[..], 1),
            (b"[rank1]:x\n", 1),
            (b"[rank]: x\n", 1),
            (b"plain [rank1]: x\n", 1),
            (b"[rank1", 1),
        ] {
            assert_eq!(strip_torch_prefix(line, rank), line);
        }
        assert_eq!(strip_torch_prefix(b"[rank12]: x\n", 12), b"x\n");
        assert_eq!(
            strip_torch_prefix(
                b"[rank1]:[E1201 14:53:58.470 ProcessGroupNCCL.cpp:1628] x\n",
                1
            ),
            b"[E1201 14:53:58.470 ProcessGroupNCCL.cpp:1628] x\n"
        );
        let other = b"[rank0]:[E1201 14:53:58.470 ProcessGroupNCCL.cpp:1628] x\n";
        assert_eq!(strip_torch_prefix(other, 1), other);
    }
}
