//! Worker output: pumps read each worker's pipes line by line, and one writer thread puts the
//! lines on the console (with a rank prefix) and into the per-rank log files.
//!
//! One writer means lines of different ranks never interleave mid-line. It is a plain thread fed
//! by a bounded channel, so a slow terminal slows the workers' pipes (back-pressure), never the
//! store, which shares the async runtime with the pumps.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{IsTerminal, Write};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::mpsc;

/// Longest line passed on whole; longer runs of bytes without a newline are split.
const MAX_LINE: usize = 64 * 1024;
/// Lines of stderr kept per worker for the failure summary.
pub const TAIL_LINES: usize = 20;

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
}

/// One worker's output settings.
pub struct WorkerOutput {
    /// e.g. "[rank3]: "; empty when there is a single worker.
    pub prefix: String,
    /// Colour index for the prefix on a terminal.
    pub colour: usize,
    pub sinks: [Sink; 2],
}

pub enum Msg {
    Line {
        worker: usize,
        stream: Stream,
        data: Vec<u8>,
    },
}

/// Last lines of a worker's stderr, kept for the failure summary.
pub type Tail = Arc<Mutex<VecDeque<String>>>;

pub struct Output {
    tx: mpsc::Sender<Msg>,
    thread: Option<JoinHandle<()>>,
}

impl Output {
    pub fn start(mut workers: Vec<WorkerOutput>) -> Output {
        let (tx, mut rx) = mpsc::channel::<Msg>(1024);
        let thread = std::thread::Builder::new()
            .name("nrun-output".into())
            .spawn(move || {
                let colour = [
                    std::io::stdout().is_terminal(),
                    std::io::stderr().is_terminal(),
                ];
                let mut line = Vec::with_capacity(256);
                while let Some(Msg::Line {
                    worker,
                    stream,
                    data,
                }) = rx.blocking_recv()
                {
                    let Some(w) = workers.get_mut(worker) else {
                        continue;
                    };
                    let sink = &mut w.sinks[stream as usize];
                    if let Some(f) = &mut sink.file {
                        let _ = f.write_all(&data);
                    }
                    if sink.console {
                        line.clear();
                        if !w.prefix.is_empty() {
                            if colour[stream as usize] {
                                let c = COLOURS[w.colour % COLOURS.len()];
                                let _ = write!(line, "\x1b[{c}m{}\x1b[0m", w.prefix);
                            } else {
                                line.extend_from_slice(w.prefix.as_bytes());
                            }
                        }
                        line.extend_from_slice(&data);
                        // Errors writing to the console (a closed pipe) must not stop the job.
                        let _ = match stream {
                            Stream::Out => std::io::stdout().lock().write_all(&line),
                            Stream::Err => std::io::stderr().lock().write_all(&line),
                        };
                    }
                }
                let _ = std::io::stdout().flush();
            })
            .ok();
        Output { tx, thread }
    }

    pub fn sender(&self) -> mpsc::Sender<Msg> {
        self.tx.clone()
    }

    /// Waits until every line sent so far is written. Pumps hold their own senders: finish
    /// them first.
    pub fn finish(self) {
        let Output { tx, thread } = self;
        drop(tx);
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

const COLOURS: [&str; 6] = ["36", "32", "33", "35", "34", "31"];

/// Copies one pipe to the writer, a line at a time, keeping the last lines in `tail`.
pub async fn pump(
    mut pipe: impl AsyncRead + Unpin,
    worker: usize,
    stream: Stream,
    tx: mpsc::Sender<Msg>,
    tail: Option<Tail>,
) {
    let mut buf: Vec<u8> = Vec::with_capacity(8192);
    let mut chunk = vec![0u8; 16384];
    loop {
        let n = match pipe.read(&mut chunk).await {
            Ok(0) | Err(_) => 0,
            Ok(n) => n,
        };
        if n == 0 {
            if !buf.is_empty() {
                buf.push(b'\n');
                emit(&tx, worker, stream, &tail, std::mem::take(&mut buf)).await;
            }
            return;
        }
        buf.extend_from_slice(&chunk[..n]);
        let mut start = 0;
        while let Some(i) = buf[start..].iter().position(|&b| b == b'\n') {
            let end = start + i + 1;
            emit(&tx, worker, stream, &tail, buf[start..end].to_vec()).await;
            start = end;
        }
        buf.drain(..start);
        if buf.len() >= MAX_LINE {
            let mut part = std::mem::take(&mut buf);
            part.push(b'\n');
            emit(&tx, worker, stream, &tail, part).await;
        }
    }
}

async fn emit(
    tx: &mpsc::Sender<Msg>,
    worker: usize,
    stream: Stream,
    tail: &Option<Tail>,
    data: Vec<u8>,
) {
    if let Some(t) = tail {
        let text = String::from_utf8_lossy(&data).trim_end().to_string();
        let mut t = t.lock().unwrap_or_else(|e| e.into_inner());
        if t.len() == TAIL_LINES {
            t.pop_front();
        }
        t.push_back(text);
    }
    let _ = tx
        .send(Msg::Line {
            worker,
            stream,
            data,
        })
        .await;
}
