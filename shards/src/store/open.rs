//! Opening the local store at start: the lock, recovery from the snapshot
//! and every shard's log, and a new snapshot that replaces them (so each
//! start compacts the log to what is live).
//!
//! Files in `store.dir`: `LOCK` (holds the PID of the process that owns the
//! directory, locked with `flock` while it runs), `snapshot-{n:016x}.log`
//! (the newest is the base), `shard-{i}/{n:016x}.log` (what each shard
//! appended since). Everything is read with ordinary reads: this runs once,
//! before the shards start.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use bytes::{Bytes, BytesMut};
use fleetmq_core::store::{put_frame, scan, Record, Recovered, FORMAT_VERSION};
use tracing::{info, warn};

/// The store directory, held, and what was recovered from it.
pub(crate) struct Opened {
    /// The directory.
    pub(crate) dir: PathBuf,
    /// Holds the `flock` on `LOCK` while it is open (see [`Opened::take_lock`]).
    lock: Option<File>,
    /// State recovered (already written again as the new snapshot).
    pub(crate) recovered: Recovered,
    /// The next log sequence number to hand out.
    pub(crate) next_lsn: u64,
    /// Bytes of the new snapshot.
    pub(crate) snapshot_bytes: u64,
}

impl Opened {
    /// The open `LOCK` file: the directory stays held as long as it is
    /// open, so the caller keeps it for the life of the process (the rest
    /// of `Opened` is dropped once the shards took what they need).
    pub(crate) fn take_lock(&mut self) -> Option<File> {
        self.lock.take()
    }
}

/// Unix milliseconds now.
pub(crate) fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Take `dir` (creating it), recover what its logs hold, write it back as
/// one snapshot and remove the files it replaces.
///
/// # Errors
/// Another process holds the directory (naming its PID); a log damaged in
/// the middle (naming file and offset) unless `truncate_corrupt`; a record
/// of an unknown format; any I/O error, naming the path.
pub(crate) fn open(dir: &Path, truncate_corrupt: bool) -> anyhow::Result<Opened> {
    let started = Instant::now();
    fs::create_dir_all(dir).with_context(|| format!("store.dir {}: cannot create it", dir.display()))?;
    let lock = lock(dir)?;
    let (snapshots, segments) = files(dir)?;
    let mut recovered = Recovered::default();
    let mut covered = 0;
    let mut read_bytes = 0u64;
    if let Some(base) = snapshots.last() {
        let (records, _) = read_file(base, truncate_corrupt, &mut read_bytes)?;
        recovered.reading_snapshot(true);
        for (i, (lsn, record)) in records.into_iter().enumerate() {
            if i == 0 {
                covered = lsn;
            }
            recovered.apply(lsn, record);
        }
        recovered.reading_snapshot(false);
    }
    let mut records = Vec::new();
    for shard_segments in &segments {
        for path in shard_segments {
            let (mut r, cut) = read_file(path, truncate_corrupt, &mut read_bytes)?;
            records.append(&mut r);
            if cut {
                // Dropping what follows a damaged record means the rest of
                // this shard's log too.
                break;
            }
        }
    }
    records.retain(|(lsn, _)| *lsn > covered);
    records.sort_by_key(|(lsn, _)| *lsn);
    for (lsn, record) in records {
        recovered.apply(lsn, record);
    }
    recovered.finish(unix_ms());
    let base = recovered.last_lsn.max(covered);
    let generation = snapshots.last().and_then(|p| number(p)).unwrap_or(0) + 1;
    let (path, snapshot_bytes, records) = write_snapshot(dir, generation, &recovered, base)?;
    // What the shards take must carry the snapshot's numbering, which the
    // records they log from now on (done with value n) refer to.
    let next_lsn = records.last().map_or(base + 1, |(lsn, _)| lsn + 1);
    let mut recovered = Recovered::default();
    recovered.reading_snapshot(true);
    for (lsn, record) in records {
        recovered.apply(lsn, record);
    }
    recovered.reading_snapshot(false);
    recovered.finish(unix_ms());
    for old in snapshots.iter().chain(segments.iter().flatten()) {
        fs::remove_file(old).with_context(|| format!("store: cannot remove {}", old.display()))?;
    }
    info!(
        target: "store",
        dir = %dir.display(),
        read_bytes,
        sessions = recovered.sessions.len(),
        retained = recovered.retained.len(),
        values = recovered.values.len(),
        snapshot = %path.display(),
        snapshot_bytes,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "store recovered"
    );
    Ok(Opened { dir: dir.to_owned(), lock: Some(lock), recovered, next_lsn, snapshot_bytes })
}

/// Lock `dir/LOCK` for this process and write its PID there.
fn lock(dir: &Path) -> anyhow::Result<File> {
    let path = dir.join("LOCK");
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("store.dir: cannot open {}", path.display()))?;
    // SAFETY: flock on a descriptor this function owns.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let mut holder = String::new();
        let _ = file.read_to_string(&mut holder);
        bail!(
            "store.dir {} is in use by another fleetmq process (PID {}, lock file {}): one process per directory",
            dir.display(),
            holder.trim(),
            path.display()
        );
    }
    file.set_len(0)?;
    file.rewind()?;
    writeln!(file, "{}", std::process::id())?;
    file.sync_all()?;
    Ok(file)
}

/// The snapshots, oldest first, and each shard's segments, in order.
fn files(dir: &Path) -> anyhow::Result<(Vec<PathBuf>, Vec<Vec<PathBuf>>)> {
    let mut snapshots = Vec::new();
    let mut shards = Vec::new();
    for entry in fs::read_dir(dir).with_context(|| format!("store.dir {}", dir.display()))? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("snapshot-") && name.ends_with(".log") {
            snapshots.push(entry.path());
        } else if name.starts_with("snapshot-") && name.ends_with(".tmp") {
            // A snapshot the last start did not finish.
            fs::remove_file(entry.path())?;
        } else if name.starts_with("shard-") && entry.path().is_dir() {
            let mut segments: Vec<PathBuf> = fs::read_dir(entry.path())?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "log"))
                .collect();
            segments.sort();
            shards.push(segments);
        }
    }
    snapshots.sort();
    Ok((snapshots, shards))
}

/// The number in a `...-{n:016x}.log` or `{n:016x}.log` file name.
fn number(path: &Path) -> Option<u64> {
    let stem = path.file_stem()?.to_str()?;
    u64::from_str_radix(stem.rsplit('-').next()?, 16).ok()
}

/// The records of one file. A torn tail is cut off (and the file truncated
/// there); damage in the middle is an error, or with `truncate_corrupt`
/// the file is cut there too and the second value is true (what follows
/// in this shard's log must be dropped).
fn read_file(path: &Path, truncate_corrupt: bool, read_bytes: &mut u64) -> anyhow::Result<(Vec<(u64, Record)>, bool)> {
    let data = Bytes::from(fs::read(path).with_context(|| format!("store: cannot read {}", path.display()))?);
    *read_bytes += data.len() as u64;
    let mut dropped = None;
    let scan = match scan(&data) {
        Ok(scan) => scan,
        Err(corrupt) if truncate_corrupt => {
            dropped = Some(corrupt.offset);
            let cut = data.slice(..corrupt.offset as usize);
            scan(&cut).expect("the part before the damage reads")
        }
        Err(corrupt) => bail!(
            "store: {} is damaged at byte offset {} (a record fails its checksum and a correct one follows at {}): \
             refusing to start, because acknowledged values may lie beyond it. To start anyway, dropping the damaged \
             record and everything after it in this shard's log, set store.truncate_corrupt = true",
            path.display(),
            corrupt.offset,
            corrupt.next_good
        ),
    };
    if scan.torn || dropped.is_some() {
        let cut = scan.valid_len;
        warn!(target: "store", file = %path.display(), offset = cut, "store: dropping a torn or damaged tail");
        let file = OpenOptions::new().write(true).open(path)?;
        file.set_len(cut)?;
        file.sync_all()?;
    }
    let mut records = Vec::with_capacity(scan.frames.len());
    for (offset, body) in scan.frames {
        let (lsn, record) = Record::decode(body)
            .with_context(|| format!("store: {} at byte offset {offset}: a record this build cannot read", path.display()))?;
        if let Record::Header { version, .. } = record {
            if version != FORMAT_VERSION {
                bail!("store: {} has record format {version}, this build reads {FORMAT_VERSION}", path.display());
            }
        }
        records.push((lsn, record));
    }
    if let Some(offset) = dropped {
        warn!(
            target: "store",
            file = %path.display(),
            offset,
            "store: a damaged record and everything after it in this shard's log were dropped (store.truncate_corrupt)"
        );
    }
    Ok((records, dropped.is_some()))
}

/// Records with their log sequence numbers.
type Records = Vec<(u64, Record)>;

/// Write `recovered` as snapshot `generation`: header (lsn `base`, the last
/// one it covers), then its records. Returns its path, size and records.
fn write_snapshot(
    dir: &Path,
    generation: u64,
    recovered: &Recovered,
    base: u64,
) -> anyhow::Result<(PathBuf, u64, Records)> {
    let path = dir.join(format!("snapshot-{generation:016x}.log"));
    let tmp = path.with_extension("tmp");
    let mut out = BytesMut::new();
    let mut body = BytesMut::new();
    Record::Header { version: FORMAT_VERSION, shard: u16::MAX, segment: generation }.encode(base, &mut body);
    put_frame(&mut out, &body);
    let records = recovered.snapshot(base + 1);
    for (lsn, record) in &records {
        body.clear();
        record.encode(*lsn, &mut body);
        put_frame(&mut out, &body);
    }
    let mut file = File::create(&tmp).with_context(|| format!("store: cannot create {}", tmp.display()))?;
    file.write_all(&out).with_context(|| format!("store: cannot write {}", tmp.display()))?;
    file.sync_all()?;
    fs::rename(&tmp, &path)?;
    File::open(dir)?.sync_all()?;
    Ok((path, out.len() as u64, records))
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use fleetmq_core::packet::{Props, QoS};
    use fleetmq_core::store::StoredMessage;

    use super::*;

    fn temp(what: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("fleetmq-open-{what}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A shard log: a header and three retained values (lsn 1..=4); returns
    /// its bytes and where the last record starts.
    fn log() -> (Vec<u8>, usize) {
        let mut out = BytesMut::new();
        let mut body = BytesMut::new();
        Record::Header { version: FORMAT_VERSION, shard: 0, segment: 0 }.encode(1, &mut body);
        put_frame(&mut out, &body);
        let mut last = 0;
        for i in 0..3u64 {
            body.clear();
            let m = StoredMessage {
                topic: format!("t/{i}").into(),
                payload: Bytes::from(format!("value {i}")),
                qos: QoS::AtLeastOnce,
                retain: true,
                properties: Props::default(),
                received_ms: unix_ms(),
                origin: 0,
            };
            Record::Value(m).encode(2 + i, &mut body);
            last = out.len();
            put_frame(&mut out, &body);
        }
        (out.to_vec(), last)
    }

    #[test]
    fn a_last_record_cut_at_any_byte_is_dropped_and_the_file_truncated() {
        let (data, last) = log();
        for cut in last + 1..data.len() {
            let dir = temp("torn");
            fs::create_dir_all(dir.join("shard-0")).unwrap();
            let path = dir.join("shard-0").join(format!("{:016x}.log", 0));
            fs::write(&path, &data[..cut]).unwrap();
            let mut read = 0;
            let (records, cut_rest) = read_file(&path, false, &mut read).unwrap();
            assert_eq!((records.len(), cut_rest), (3, false), "cut at {cut}");
            assert_eq!(fs::metadata(&path).unwrap().len(), last as u64, "truncated at the torn record");
            let opened = open(&dir, false).unwrap();
            let mut topics: Vec<&str> = opened.recovered.retained.keys().map(|t| &**t).collect();
            topics.sort();
            assert_eq!(topics, ["t/0", "t/1"], "cut at {cut}");
            drop(opened);
            fs::remove_dir_all(&dir).unwrap();
        }
    }

    #[test]
    fn a_store_dir_is_recovered_the_same_after_each_start() {
        let (data, _) = log();
        let dir = temp("again");
        fs::create_dir_all(dir.join("shard-0")).unwrap();
        fs::write(dir.join("shard-0").join(format!("{:016x}.log", 0)), &data).unwrap();
        let first = open(&dir, false).unwrap();
        let lsn = first.next_lsn;
        drop(first);
        let second = open(&dir, false).unwrap();
        assert_eq!(second.recovered.retained.len(), 3);
        assert!(second.next_lsn > lsn, "sequence numbers keep growing");
        assert!(dir.join("snapshot-0000000000000002.log").exists());
        assert!(!dir.join("snapshot-0000000000000001.log").exists());
        drop(second);
        fs::remove_dir_all(&dir).unwrap();
    }
}
