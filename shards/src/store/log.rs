//! One shard's append-only log: records are framed into a buffer as the
//! shard appends them, and a committer task writes the buffer with one
//! io_uring write (glommio DMA file, `O_DIRECT`) and one `fdatasync`, then
//! writes the acknowledgements that waited for it (group commit).
//!
//! A direct write must start and end on the device's alignment: the
//! committer rewrites the last, partly filled block of the file together
//! with the new bytes, padded with zeros (which the reader takes as the
//! end of the frames). Where `O_DIRECT` is refused (`EINVAL`: tmpfs), the
//! file is opened buffered and written at its end.

use std::cell::{Cell, RefCell};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use fleetmq_core::store::{put_frame, Record, FORMAT_VERSION};
use fleetmq_core::settings::Fsync;
use glommio::io::{BufferedFile, DmaFile, OpenOptions};
use tracing::{info, warn};

use super::acks::AckQueue;
use super::health::Health;
use super::Token;

/// A segment is closed and the next one started past this size.
const SEGMENT_BYTES: u64 = 64 << 20;

/// Gather at most this many bytes before a `batch` sync starts early.
const BATCH_BYTES: usize = 256 << 10;

/// While the store fails, try again this often.
const RETRY_EVERY: Duration = Duration::from_millis(500);

/// The segment file, direct or buffered.
enum SegmentFile {
    Direct(DmaFile),
    Buffered(BufferedFile),
}

/// What a shard's log shares between the shard and its committer task.
pub(crate) struct ShardLog {
    shard: usize,
    dir: PathBuf,
    fsync: Fsync,
    window: Duration,
    /// Node-wide source of log sequence numbers.
    lsn: Arc<AtomicU64>,
    health: Arc<Health>,
    /// Framed records not yet handed to a write.
    pending: RefCell<BytesMut>,
    /// Bytes appended since start: the token of the newest append.
    appended: Cell<Token>,
    /// Appended bytes that are durable.
    durable: Cell<Token>,
    /// When the oldest pending append was made.
    first_pending: Cell<Option<Instant>>,
    acks: Rc<AckQueue>,
    wake: crate::signal::Signal,
    stopping: Cell<bool>,
}

impl ShardLog {
    /// The log of shard `shard` in `dir` (`shard-{shard}/`).
    pub(crate) fn new(
        shard: usize,
        dir: PathBuf,
        store: &fleetmq_core::settings::Store,
        lsn: Arc<AtomicU64>,
        health: Arc<Health>,
        acks: Rc<AckQueue>,
    ) -> ShardLog {
        ShardLog {
            shard,
            dir: dir.join(format!("shard-{shard}")),
            fsync: store.fsync,
            window: store.fsync_window,
            lsn,
            health,
            pending: RefCell::new(BytesMut::new()),
            appended: Cell::new(0),
            durable: Cell::new(0),
            first_pending: Cell::new(None),
            acks,
            wake: crate::signal::Signal::default(),
            stopping: Cell::new(false),
        }
    }

    /// Append `record`; returns its log sequence number.
    pub(crate) fn append(&self, record: &Record) -> u64 {
        let lsn = self.lsn.fetch_add(1, Ordering::Relaxed);
        let mut body = BytesMut::new();
        record.encode(lsn, &mut body);
        let mut pending = self.pending.borrow_mut();
        let before = pending.len();
        put_frame(&mut pending, &body);
        self.appended.set(self.appended.get() + (pending.len() - before) as u64);
        if self.first_pending.get().is_none() {
            self.first_pending.set(Some(Instant::now()));
            self.wake.notify();
        }
        lsn
    }

    /// The token that covers everything appended so far.
    pub(crate) fn appended(&self) -> Token {
        self.appended.get()
    }

    /// True when everything appended so far is durable.
    pub(crate) fn all_durable(&self) -> bool {
        self.appended.get() == self.durable.get()
    }

    /// True while the store refuses (a failed write, or `store.max_bytes`).
    pub(crate) fn refusing(&self) -> bool {
        self.health.refusing()
    }

    /// Ask the committer to write what is pending and end.
    pub(crate) fn stop(&self) {
        self.stopping.set(true);
        self.wake.notify();
    }

    /// The committer: runs on the shard's executor until [`ShardLog::stop`].
    pub(crate) async fn run(self: Rc<Self>) {
        let mut writer = match Writer::open(&self).await {
            Ok(w) => w,
            Err(e) => {
                self.health.fail(self.shard, format!("cannot open the log in {}: {e}", self.dir.display()));
                return;
            }
        };
        loop {
            if self.pending.borrow().is_empty() {
                if self.stopping.get() {
                    break;
                }
                self.wake.wait().await;
                continue;
            }
            self.gather().await;
            let token = self.appended.get();
            let chunk = std::mem::take(&mut *self.pending.borrow_mut());
            self.first_pending.set(None);
            match writer.commit(&self, &chunk).await {
                Ok(()) => {
                    self.durable.set(token);
                    self.health.recovered(self.shard);
                    self.acks.complete(token);
                }
                Err(e) => {
                    self.health.fail(self.shard, format!("writing {}: {e}", self.dir.display()));
                    self.acks.fail(token);
                    // Keep the records, in order, for the next try: they
                    // are facts the shard already acted on.
                    {
                        let mut pending = self.pending.borrow_mut();
                        let newer = std::mem::replace(&mut *pending, chunk);
                        pending.extend_from_slice(&newer);
                    }
                    self.first_pending.set(Some(Instant::now()));
                    if self.stopping.get() {
                        break;
                    }
                    glommio::timer::sleep(RETRY_EVERY).await;
                }
            }
        }
        info!(target: "store", shard = self.shard, "log closed");
    }

    /// `batch`: wait until the window since the first pending append ends
    /// or enough is gathered.
    async fn gather(&self) {
        if self.fsync != Fsync::Batch || self.stopping.get() {
            return;
        }
        let Some(first) = self.first_pending.get() else { return };
        let until = first + self.window;
        while self.pending.borrow().len() < BATCH_BYTES && !self.stopping.get() {
            let now = Instant::now();
            if now >= until {
                break;
            }
            glommio::timer::sleep((until - now).min(Duration::from_micros(250))).await;
        }
    }
}

/// The committer's file state.
struct Writer {
    file: SegmentFile,
    segment: u64,
    /// Logical length of the segment (frames only, no padding).
    len: u64,
    /// The bytes of the segment's last, partly filled block.
    tail: Vec<u8>,
}

impl Writer {
    async fn open(log: &ShardLog) -> std::io::Result<Writer> {
        std::fs::create_dir_all(&log.dir)?;
        let mut writer = Writer { file: create(&log.dir, 0).await?, segment: 0, len: 0, tail: Vec::new() };
        writer.start_segment(log).await?;
        Ok(writer)
    }

    /// Write the header of a new segment (with the data that follows).
    async fn start_segment(&mut self, log: &ShardLog) -> std::io::Result<()> {
        let mut body = BytesMut::new();
        let header = Record::Header { version: FORMAT_VERSION, shard: log.shard as u16, segment: self.segment };
        header.encode(log.lsn.fetch_add(1, Ordering::Relaxed), &mut body);
        let mut frame = BytesMut::new();
        put_frame(&mut frame, &body);
        self.write(&frame).await?;
        Ok(())
    }

    /// Write `chunk` after what the segment holds and sync per `store.fsync`.
    async fn commit(&mut self, log: &ShardLog, chunk: &[u8]) -> std::io::Result<()> {
        let started = Instant::now();
        self.write(chunk).await?;
        if log.fsync != Fsync::Never {
            match &self.file {
                SegmentFile::Direct(f) => f.fdatasync().await?,
                SegmentFile::Buffered(f) => f.fdatasync().await?,
            }
        }
        log.health.synced(log.shard, chunk.len() as u64, started.elapsed());
        if self.len >= SEGMENT_BYTES {
            self.segment += 1;
            let file = create(&log.dir, self.segment).await?;
            (self.file, self.len) = (file, 0);
            self.tail.clear();
            self.start_segment(log).await?;
        }
        Ok(())
    }

    /// Write `data` at the segment's logical end. On error nothing moves:
    /// the next try rewrites from the same place.
    async fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
        match &self.file {
            SegmentFile::Buffered(f) => {
                f.write_at(data.to_vec(), self.len).await?;
                self.len += data.len() as u64;
            }
            SegmentFile::Direct(f) => {
                let start = f.align_down(self.len);
                let end = self.len + data.len() as u64;
                let size = (f.align_up(end) - start) as usize;
                let mut buf = f.alloc_dma_buffer(size);
                let bytes = buf.as_bytes_mut();
                bytes[..self.tail.len()].copy_from_slice(&self.tail);
                bytes[self.tail.len()..self.tail.len() + data.len()].copy_from_slice(data);
                bytes[self.tail.len() + data.len()..].fill(0);
                let block_start = f.align_down(end);
                let new_tail = bytes[(block_start - start) as usize..(end - start) as usize].to_vec();
                let written = f.write_at(buf, start).await?;
                if written < size {
                    return Err(std::io::Error::new(std::io::ErrorKind::WriteZero, "short direct write"));
                }
                self.len = end;
                self.tail = new_tail;
            }
        }
        Ok(())
    }
}

/// Create segment `n` in `dir`: direct I/O, or buffered where the file
/// system refuses `O_DIRECT`.
async fn create(dir: &std::path::Path, n: u64) -> std::io::Result<SegmentFile> {
    let path = dir.join(format!("{n:016x}.log"));
    let mut options = OpenOptions::new();
    options.read(true).write(true).create(true).truncate(true);
    match options.dma_open(&path).await {
        Ok(f) => Ok(SegmentFile::Direct(f)),
        Err(e) if raw_os_error(&e) == Some(libc::EINVAL) => {
            warn!(target: "store", file = %path.display(), "O_DIRECT refused (EINVAL): writing buffered");
            Ok(SegmentFile::Buffered(options.buffered_open(&path).await?))
        }
        Err(e) => Err(e.into()),
    }
}

fn raw_os_error(e: &glommio::GlommioError<()>) -> Option<i32> {
    match e {
        glommio::GlommioError::IoError(io) => io.raw_os_error(),
        glommio::GlommioError::EnhancedIoError { source, .. } => source.raw_os_error(),
        _ => None,
    }
}
