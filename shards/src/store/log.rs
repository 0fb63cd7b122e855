//! One shard's append-only log: records are framed into a buffer as the
//! shard appends them, and a committer task writes the buffer with one
//! io_uring write (glommio DMA file, `O_DIRECT`) and one `fdatasync`, then
//! writes the acknowledgements that waited for it (group commit).
//!
//! When the compactor asks ([`super::compact::Roll`]), the committer rolls
//! the log at the compactor's cut: records up to the cut go to the
//! current segment, the rest to a new one.
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
use fleetmq_core::store::frame::FRAME_HEADER;
use fleetmq_core::store::{put_frame, Record, FORMAT_VERSION};
use fleetmq_core::settings::Fsync;
use glommio::io::{BufferedFile, DmaFile, OpenOptions};
use tracing::{info, warn};

use super::acks::AckQueue;
use super::compact::Roll;
use super::health::Health;
use super::watermark::Watermark;
use super::Token;

/// A segment is closed and the next one started past this size.
const SEGMENT_BYTES: u64 = 64 << 20;

/// Gather at most this many bytes before a `batch` sync starts early.
const BATCH_BYTES: usize = 256 << 10;

/// While the store fails, try again this often.
const RETRY_EVERY: Duration = Duration::from_millis(500);

/// An idle committer looks for a roll request this often.
const ROLL_POLL: Duration = Duration::from_millis(20);

/// While a PUBLISH waits only for another shard's sync, look this often.
const FOREIGN_POLL: Duration = Duration::from_micros(200);

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
    /// The compactor's roll requests.
    roll: Arc<Roll>,
    /// The newest roll request this log rolled for.
    rolled: Cell<u64>,
    /// Every shard's oldest record not yet durable.
    watermark: Arc<Watermark>,
    /// Sequence number of the newest append.
    last_lsn: Cell<u64>,
    /// Sequence number of the oldest record in `pending`.
    pending_first: Cell<Option<u64>>,
    /// Sequence number of the oldest record being written, and the token
    /// that covers what is being written.
    writing: Cell<Option<(u64, Token)>>,
}

impl ShardLog {
    /// The log of shard `shard` of the local store `local` (in
    /// `shard-{shard}/` of its directory), completing `acks`.
    pub(crate) fn new(shard: usize, local: &super::LocalStart, acks: Rc<AckQueue>) -> ShardLog {
        let store = &local.settings;
        ShardLog {
            shard,
            dir: local.opened.dir.join(format!("shard-{shard}")),
            fsync: store.fsync,
            window: store.fsync_window,
            lsn: local.lsn.clone(),
            health: local.health.clone(),
            pending: RefCell::new(BytesMut::new()),
            appended: Cell::new(0),
            durable: Cell::new(0),
            first_pending: Cell::new(None),
            acks,
            wake: crate::signal::Signal::default(),
            stopping: Cell::new(false),
            roll: local.roll.clone(),
            rolled: Cell::new(0),
            watermark: local.watermark.clone(),
            last_lsn: Cell::new(0),
            pending_first: Cell::new(None),
            writing: Cell::new(None),
        }
    }

    /// Append `record`; returns its log sequence number.
    pub(crate) fn append(&self, record: &Record) -> u64 {
        // SeqCst: ordered with the compactor's cut (see `compact`).
        let lsn = self.lsn.fetch_add(1, Ordering::SeqCst);
        let mut body = BytesMut::new();
        record.encode(lsn, &mut body);
        let mut pending = self.pending.borrow_mut();
        let before = pending.len();
        put_frame(&mut pending, &body);
        self.appended.set(self.appended.get() + (pending.len() - before) as u64);
        self.last_lsn.set(lsn);
        if self.pending_first.get().is_none() {
            self.pending_first.set(Some(lsn));
            self.publish_oldest();
        }
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

    /// Sequence number of the newest append.
    pub(crate) fn last_lsn(&self) -> u64 {
        self.last_lsn.get()
    }

    /// Every shard's log is durable up to this sequence number.
    pub(crate) fn durable_lsn(&self) -> u64 {
        self.watermark.durable()
    }

    /// Tell the other shards this log's oldest record not yet durable.
    fn publish_oldest(&self) {
        let writing = self.writing.get().map(|(first, _)| first);
        self.watermark.set_oldest(self.shard, writing.or(self.pending_first.get()));
    }

    /// True when everything appended so far is durable.
    pub(crate) fn all_durable(&self) -> bool {
        self.appended.get() == self.durable.get()
    }

    /// True while the store refuses publishes (a failed write, or
    /// `store.max_bytes`).
    pub(crate) fn refusing(&self) -> bool {
        self.health.refusing()
    }

    /// True while a shard's writes fail.
    pub(crate) fn failing(&self) -> bool {
        self.health.failing()
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
            if let Some(request) = self.roll.asked(self.rolled.get()) {
                if !self.roll_at_cut(&mut writer, request).await {
                    if self.stopping.get() {
                        break;
                    }
                    glommio::timer::sleep(RETRY_EVERY).await;
                }
                continue;
            }
            if self.pending.borrow().is_empty() {
                if self.stopping.get() {
                    break;
                }
                // A PUBLISH that waits only for another shard's sync: look
                // again soon.
                let poll = if self.acks.complete(self.durable.get()) { FOREIGN_POLL } else { ROLL_POLL };
                futures_lite::future::or(self.wake.wait(), glommio::timer::sleep(poll)).await;
                continue;
            }
            self.gather().await;
            // Looked at right before the records are taken (see `compact`).
            if self.roll.asked(self.rolled.get()).is_some() {
                continue;
            }
            let (token, chunk) = self.take();
            if let Err(e) = writer.commit(&self, &chunk).await {
                self.failed(token, chunk, e);
                if self.stopping.get() {
                    break;
                }
                glommio::timer::sleep(RETRY_EVERY).await;
                continue;
            }
            self.committed(token);
        }
        info!(target: "store", shard = self.shard, "log closed");
    }

    /// The pending records and the token that covers them.
    fn take(&self) -> (Token, BytesMut) {
        self.first_pending.set(None);
        let token = self.appended.get();
        if let Some(first) = self.pending_first.take() {
            // What is still being written from an earlier take is older.
            let first = self.writing.get().map_or(first, |(older, _)| older);
            self.writing.set(Some((first, token)));
        }
        (token, std::mem::take(&mut *self.pending.borrow_mut()))
    }

    /// Durable up to `token`: its acknowledgements go out.
    fn committed(&self, token: Token) {
        self.durable.set(token);
        if self.writing.get().is_some_and(|(_, until)| until <= token) {
            self.writing.set(None);
            self.publish_oldest();
        }
        self.health.recovered(self.shard);
        self.acks.complete(token);
    }

    /// Writing `chunk` (records up to `token`) failed: refuse what waits
    /// for it and keep the records, in order, for the next try: they are
    /// facts the shard already acted on.
    fn failed(&self, token: Token, chunk: BytesMut, e: std::io::Error) {
        self.health.fail(self.shard, format!("writing {}: {e}", self.dir.display()));
        self.acks.fail(token);
        let mut pending = self.pending.borrow_mut();
        let newer = std::mem::replace(&mut *pending, chunk);
        pending.extend_from_slice(&newer);
        drop(pending);
        self.first_pending.set(Some(Instant::now()));
        // The chunk goes back in front of what came since.
        if let Some((first, _)) = self.writing.take() {
            self.pending_first.set(Some(first));
        }
    }

    /// Roll the log for the compactor's `request`: once its cut is
    /// published, write the records up to it to the current segment,
    /// start a new segment and write the rest there. False when a write
    /// failed (the records are kept; the roll is tried again if it was not
    /// made).
    async fn roll_at_cut(&self, writer: &mut Writer, request: u64) -> bool {
        let cut = loop {
            if let Some(cut) = self.roll.cut() {
                break cut;
            }
            glommio::timer::sleep(Duration::from_micros(50)).await;
        };
        let start = self.durable.get();
        let (token, mut chunk) = self.take();
        let split = split_at(&chunk, cut);
        if split > 0 {
            if let Err(e) = writer.commit(self, &chunk[..split]).await {
                self.failed(token, chunk, e);
                return false;
            }
            self.committed(start + split as u64);
        }
        let rest = chunk.split_off(split);
        if let Err(e) = writer.next_segment(self).await {
            self.failed(token, rest, e);
            return false;
        }
        self.rolled.set(request);
        self.roll.rolled(self.shard, request, writer.segment);
        if !rest.is_empty() {
            if let Err(e) = writer.commit(self, &rest).await {
                self.failed(token, rest, e);
                return false;
            }
        }
        self.committed(token);
        true
    }

    /// `batch`: gather what the shard appends before a write starts, without
    /// waiting for time. The committer writes one batch at a time, so what
    /// arrives while a write and its `fdatasync` run is the next batch,
    /// written as soon as that sync ends: the batch grows as the disk slows,
    /// and an idle committer starts at once. Before it starts, it lets the
    /// tasks already runnable (connections whose packets were read in this
    /// turn) append too: one yield to the executor, no timer. The wait is
    /// bounded by `store.fsync_window` since the first pending append (it
    /// ends earlier at `BATCH_BYTES`); `always` does not yield.
    async fn gather(&self) {
        if self.fsync != Fsync::Batch || self.stopping.get() {
            return;
        }
        let Some(first) = self.first_pending.get() else { return };
        if self.pending.borrow().len() < BATCH_BYTES && first.elapsed() < self.window {
            futures_lite::future::yield_now().await;
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
    /// A new segment after those the directory holds.
    async fn open(log: &ShardLog) -> std::io::Result<Writer> {
        std::fs::create_dir_all(&log.dir)?;
        let mut next = 0;
        for entry in std::fs::read_dir(&log.dir)? {
            let path = entry?.path();
            if path.extension().is_some_and(|x| x == "log") {
                next = next.max(super::open::number(&path).map_or(0, |n| n + 1));
            }
        }
        let mut writer = Writer { file: create(&log.dir, next).await?, segment: next, len: 0, tail: Vec::new() };
        writer.start_segment(log).await?;
        Ok(writer)
    }

    /// Close the segment and start the next one.
    async fn next_segment(&mut self, log: &ShardLog) -> std::io::Result<()> {
        let file = create(&log.dir, self.segment + 1).await?;
        self.segment += 1;
        (self.file, self.len) = (file, 0);
        self.tail.clear();
        self.start_segment(log).await
    }

    /// Write the header of a new segment (with the data that follows).
    async fn start_segment(&mut self, log: &ShardLog) -> std::io::Result<()> {
        let mut body = BytesMut::new();
        let header = Record::Header { version: FORMAT_VERSION, shard: log.shard as u16, segment: self.segment };
        header.encode(log.lsn.fetch_add(1, Ordering::Relaxed), &mut body);
        let mut frame = BytesMut::new();
        put_frame(&mut frame, &body);
        self.write(&frame).await?;
        log.health.grew(log.shard, frame.len() as u64);
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
            self.next_segment(log).await?;
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

/// Where `chunk` (frames of records numbered in increasing order) splits
/// at `cut`: the offset of the first record numbered above it.
fn split_at(chunk: &[u8], cut: u64) -> usize {
    let mut at = 0;
    while at + FRAME_HEADER + 9 <= chunk.len() {
        let len = u32::from_le_bytes(chunk[at..at + 4].try_into().expect("4 bytes")) as usize;
        // The body: kind (1 byte), then the sequence number.
        let body = at + FRAME_HEADER;
        let lsn = u64::from_le_bytes(chunk[body + 1..body + 9].try_into().expect("8 bytes"));
        if lsn > cut {
            return at;
        }
        at = body + len;
    }
    chunk.len()
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Frames of one record (all of one size) per number in `lsns`.
    fn records(lsns: &[u64]) -> Vec<u8> {
        let mut out = BytesMut::new();
        for &lsn in lsns {
            let mut body = BytesMut::new();
            Record::Done { client_id: "c".into(), value: lsn }.encode(lsn, &mut body);
            put_frame(&mut out, &body);
        }
        out.to_vec()
    }

    #[test]
    fn pending_records_split_before_the_first_one_above_the_cut() {
        let chunk = records(&[3, 5, 8, 9]);
        let one = chunk.len() / 4;
        assert_eq!(split_at(&chunk, 2), 0);
        assert_eq!(split_at(&chunk, 3), one);
        assert_eq!(split_at(&chunk, 7), 2 * one);
        assert_eq!(split_at(&chunk, 9), chunk.len());
        assert_eq!(split_at(&[], 9), 0);
    }
}
