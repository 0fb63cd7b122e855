//! A connection's task once it is attached to its session: reads,
//! decodes and handles packets, writes what the shard queued for it, and
//! closes it ([`drive`]; the accepting side is in the parent module).

use super::*;

/// Attach the connection to its session and serve it until it closes, or
/// hand it to the shard that holds the session (see `shard::placement`;
/// `via`: the generation of the forwarding entry that sent it here).
pub(super) async fn serve(
    shard: Rc<Shard>,
    settings: Rc<ConnSettings>,
    mut connecting: Connecting,
    via: Option<u64>,
) {
    // A later CONNECT of the client identifier claimed it: refused (also
    // one that came while a taken-up session's routes were awaited).
    if superseded(&connecting) || (take_up(&shard, &mut connecting).await && superseded(&connecting)) {
        let refusal = Refusal {
            reason: ReasonCode::SERVER_UNAVAILABLE,
            detail: "a later CONNECT of this client identifier claimed it",
        };
        refuse(&shard, &mut connecting.transport, &connecting.connect, refusal).await;
        refused(&shard, &settings, RefuseReason::ClientIdInUse);
        return;
    }
    // The connection's long life runs in a task of its own, so nothing this
    // one holds (the CONNECT, the negotiated CONNACK) is kept while idle.
    match start(&shard, &settings, &mut connecting) {
        Ok((conn, slot)) => {
            if let Some(claim) = &connecting.admission.claim {
                if !crate::cluster::shard_state(|sc| sc.attached(claim)) {
                    // Another replica's later claim arrived first.
                    conn.request_close(Some(ReasonCode::SESSION_TAKEN_OVER), false);
                }
            }
            let Connecting {
                transport,
                unread,
                admission,
                ..
            } = connecting;
            spawn_attached(shard, settings, transport, conn, slot, admission, &unread);
        }
        Err(AttachError::Refused(refusal)) => {
            refuse(&shard, &mut connecting.transport, &connecting.connect, refusal).await;
            refused(&shard, &settings, RefuseReason::ClientIdInUse);
        }
        Err(AttachError::Elsewhere { to, generation }) => {
            hand_off(&shard, to, Route::ViaHome(generation), connecting).await;
        }
        Err(AttachError::NotHere) => {
            let home = owner_of(&connecting.negotiated.client_id, shard.shards);
            let route = Route::NotHere(via.unwrap_or(0));
            hand_off(&shard, home, route, connecting).await;
        }
    }
}

/// Whether a later CONNECT of this connection's client identifier
/// claimed it on this replica.
fn superseded(connecting: &Connecting) -> bool {
    connecting.admission.claim.as_ref().is_some_and(|claim| crate::cluster::shard_state(|sc| sc.superseded(claim)))
}

/// A session another replica served is taken up on the shard that holds
/// the client identifier (else the record travels on), and its CONNACK
/// waits (at most 2 s) for its routes, written and announced to the
/// peers, as a SUBACK does. True when it waited.
async fn take_up(shard: &Rc<Shard>, connecting: &mut Connecting) -> bool {
    let Some(claim) = connecting.admission.claim.as_mut() else { return false };
    if claim.taken_up.is_none() || !shard.holds_home(&connecting.negotiated.client_id) {
        return false;
    }
    let Some(record) = claim.taken_up.take() else { return false };
    let own = claim.is_own(&record);
    let resume = claim.resume.take();
    let inbound_qos2 = std::mem::take(&mut claim.inbound_qos2);
    let routes = shard.take_up(&record, own, resume.as_deref(), &inbound_qos2, Instant::now());
    if routes.is_empty() {
        return false;
    }
    routes.ready().await;
    true
}

/// Attach to the session (the CONNACK goes out).
fn start(
    shard: &Rc<Shard>,
    settings: &ConnSettings,
    connecting: &mut Connecting,
) -> Result<(Rc<ConnShared>, crate::shard::Slot), AttachError> {
    let Connecting {
        connect,
        negotiated,
        admission,
        ..
    } = connecting;
    let protocol = connect.protocol;
    let key = shard.global.next_conn_key.fetch_add(1, Ordering::Relaxed);
    let now = Instant::now();
    let expires_at = admission.identity.expires_at.map(|at| {
        now + at
            .duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO)
    });
    let conn = Rc::new(ConnShared::new(
        key,
        protocol,
        negotiated.keep_alive,
        expires_at,
        now,
    ));
    let authorizer =
        AclAuthorizer::for_client(&settings.auth, &admission.identity, &negotiated.client_id);
    let slot = shard.attach(
        connect,
        negotiated,
        &admission.identity,
        authorizer,
        settings.acl_cache,
        &conn,
        now,
    )?;
    Ok((conn, slot))
}

/// What the connection's task woke up for.
enum Event {
    /// `n` bytes were read into the connection's buffer.
    Read(usize),
    /// The client closed the connection (EOF or a read error).
    Eof,
    /// A write failed: the client is gone.
    WriteFailed,
    /// The connection was asked to close.
    Close,
    /// The shard asked an idle connection to park, and nothing is pending.
    Park,
    /// The connection is to move to this shard (see `shard::placement`),
    /// and nothing is pending.
    Move(usize),
    /// Retained messages wait for its subscriptions and the socket has
    /// drained (see `shard::retained`).
    Feed,
    /// Its packets are handled again: fewer of its values are held
    /// behind a retained value than pause it (`Io::paused`).
    Resume,
}

/// The connection's life in one task: read, decode and handle packets, and
/// write what the shard queued for it, until it closes. Reads and writes
/// are polled together, so a client that is slow to read never stops its
/// own packets from being read (its acknowledgements free the window), and
/// one task per connection keeps an idle connection small (DESIGN.md §3).
// A function returning an `async move` block, not an `async fn`: an async
// fn keeps its arguments twice in its state (as arguments and as locals),
// and this state is what every connection holds for its whole life.
#[allow(clippy::manual_async_fn, clippy::too_many_arguments)]
pub(super) fn drive(
    shard: Rc<Shard>,
    settings: Rc<ConnSettings>,
    mut transport: Transport,
    conn: Rc<ConnShared>,
    slot: crate::shard::Slot,
    mut admission: Admission,
    mut buf: BytesMut,
    resumed: bool,
) -> impl std::future::Future<Output = ()> {
    async move {
        let protocol = conn.protocol;
        conn.parkable.set(matches!(transport, Transport::Tcp(_)));
        if !resumed {
            shard.live_connections.set(shard.live_connections.get() + 1);
            shard.metrics.clients_connected.inc();
            shard.flush().await;
        }

        let mut io = Io {
            writing: BytesMut::new(),
            unflushed: false,
            move_to: None,
            paused: None,
        };
        let mut mover = Mover::default();
        if !conn.parkable.get() || !shard.is_home_of(slot) {
            conn.unmovable.set(true);
        }
        let max_packet = settings.connect.max_packet_size;
        // One clock read per batch of packets read together.
        let mut read_at = conn.last_packet.get();
        // Whether the will is published, and how the connection closes: the
        // broker lingers after its own last packet, not after the client's.
        let (publish_will, linger) = 'conn: loop {
            let now = read_at;
            loop {
                if let Some(close) = conn.close.get() {
                    break 'conn (close.publish_will, Linger::AFTER_DISCONNECT);
                }
                // Too many of this client's values wait behind a retained
                // value the cluster has not stored yet: read no more.
                if let Some(origin) = shard.pause_publisher(slot, &conn) {
                    io.paused = Some(origin);
                    break;
                }
                match decode(&mut buf, Some(protocol), max_packet) {
                    // A packet that ends the connection sets `conn.close`,
                    // seen at the top of this loop.
                    Ok(Some(packet)) => {
                        // Keep alive: a whole packet, not a byte, arrived.
                        conn.last_packet.set(now);
                        let reach = shard.handle_packet(slot, &conn, packet, now);
                        if let Some(to) = mover.note(reach, shard.id, now, &conn.unmovable) {
                            if shard.may_move_to(to) {
                                io.move_to = Some(to);
                            }
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        // Malformed: MQTT 5 gets DISCONNECT 0x81/0x82/0x95;
                        // 3.1.1 a closed connection (MQTT 5 §4.13).
                        debug!(target: "broker", error = %e, "malformed packet");
                        conn.request_close(Some(e.reason_code()), true);
                        break 'conn (true, Linger::AFTER_DISCONNECT);
                    }
                }
            }
            shard.flush_soon().await;
            if buf.is_empty() && buf.capacity() > BUFFER_KEEP {
                buf = BytesMut::new();
            }
            match std::future::poll_fn(|cx| io.poll(cx, &shard, &conn, &mut transport, &mut buf))
                .await
            {
                Event::Read(n) => {
                    shard.metrics.bytes_in.inc_by(n as u64);
                    read_at = Instant::now();
                    conn.active.set(true);
                    if conn.feeding.get() == Feeding::Blocked {
                        // An acknowledgement may have opened the window.
                        conn.feeding.set(Feeding::Ready);
                    }
                    // glommio reads a socket that has bytes at once, without
                    // a turn of the executor: a client that never stops
                    // sending would keep this task running, and the shard's
                    // other connections and its cluster events (a fence's
                    // close among them) would wait for good. It gives way
                    // once its time slice is over (glommio's preemption
                    // timer, 100 ms by default).
                    glommio::yield_if_needed().await;
                }
                // Decode what was read meanwhile.
                Event::Resume => read_at = Instant::now(),
                Event::Feed => {
                    shard.feed_retained(slot, &conn, Instant::now());
                    // A batch at a time: the shard's other tasks run between.
                    futures_lite::future::yield_now().await;
                }
                Event::Park => {
                    conn.park_requested.set(false);
                    // Nothing is queued (checked before parking): give the
                    // write buffers' memory back.
                    *conn.out.borrow_mut() = BytesMut::new();
                    io.writing = BytesMut::new();
                    if let Transport::Tcp(stream) = transport {
                        let Some(fd) = dup(&stream) else {
                            transport = Transport::Tcp(stream);
                            continue;
                        };
                        // Dropping the stream ends glommio's poll and closes
                        // its descriptor; the socket lives on in `fd`. The
                        // poll's cancellation joins glommio's queue, which
                        // grows when many connections park at once: its old
                        // blocks go back to the system (see crate::alloc).
                        crate::alloc::giving_back(|| drop(stream));
                        let parked = Parked {
                            fd,
                            conn,
                            slot,
                            admission,
                        };
                        match crate::park::park(parked) {
                            Ok(()) => {
                                shard.metrics.connections_parked.inc();
                                return;
                            }
                            Err(parked) => return respawn(shard, settings, parked, buf),
                        }
                    }
                }
                Event::Move(to) => {
                    io.move_to = None;
                    let Transport::Tcp(stream) = transport else {
                        unreachable!("only TCP connections move")
                    };
                    let Some(fd) = dup(&stream) else {
                        transport = Transport::Tcp(stream);
                        continue;
                    };
                    // What is left of a packet goes along.
                    let unread = buf.split().freeze();
                    match shard.move_out(slot, &conn, to, fd, unread.clone(), admission) {
                        Ok(()) => {
                            // As for parking: the socket lives on in `fd`.
                            drop(stream);
                            shard.live_connections.set(shard.live_connections.get() - 1);
                            shard.metrics.clients_connected.dec();
                            return;
                        }
                        Err((fd, back)) => {
                            drop(fd);
                            admission = back;
                            buf = BytesMut::from(&unread[..]);
                            transport = Transport::Tcp(stream);
                        }
                    }
                }
                Event::Eof | Event::WriteFailed => {
                    // Closed without DISCONNECT: the will is published
                    // `[MQTT-3.1.2-8]`.
                    conn.request_close(None, true);
                    break (true, Linger::NONE);
                }
                Event::Close => {
                    let close = conn
                        .close
                        .get()
                        .expect("Event::Close follows a close request");
                    break (close.publish_will, Linger::AFTER_DISCONNECT);
                }
            }
        };
        shard.detach(slot, &conn, publish_will, Instant::now());
        shard.flush().await;
        // What is still queued and the acknowledgements that wait for the
        // store go out, then the DISCONNECT with its reason code, nothing
        // after it [MQTT-3.14.4-1], if the client takes them within
        // CLOSE_FLUSH. Acknowledgements the store has not covered by then
        // are not sent: the client publishes those values again.
        let flushed = or(
            async {
                io.drain(&shard, &conn, &mut transport, true).await;
                true
            },
            async {
                sleep(CLOSE_FLUSH).await;
                false
            },
        )
        .await;
        if conn.close.get().is_some_and(|c| c.disconnect.is_some()) {
            if !flushed {
                // What waits for the store stays behind the DISCONNECT.
                conn.out.borrow_mut().clear();
            }
            conn.send_disconnect();
            or(io.drain(&shard, &conn, &mut transport, false), sleep(CLOSE_FLUSH)).await;
        }
        drop(admission);
        shard.metrics.clients_connected.dec();
        // Boxed: only a closing connection holds this state. The shard's
        // stop waits for it (`live_connections`), within its deadline.
        Box::pin(closing::close(&mut transport, linger)).await;
        shard.live_connections.set(shard.live_connections.get() - 1);
    }
}

/// The write side of a connection's task.
struct Io {
    /// Bytes taken from `ConnShared::out`, not yet accepted by the socket.
    writing: BytesMut,
    /// A TLS or WebSocket transport holds written bytes until flushed.
    unflushed: bool,
    /// Move to this shard once nothing is pending (see `shard::placement`).
    move_to: Option<usize>,
    /// No packet is read or handled while this publisher (by its client
    /// key) has as many values held as the shard holds (cluster mode,
    /// see `crate::shard::held`).
    paused: Option<u64>,
}

impl Io {
    /// Write what is queued, as far as the socket takes it, then read.
    /// Ready with the first thing that needs the task: data read, EOF, a
    /// failed write or a close request; Pending (with every waker
    /// registered: socket readable, socket writable while bytes wait, the
    /// connection's signal) otherwise.
    fn poll(
        &mut self,
        cx: &mut Context<'_>,
        shard: &Shard,
        conn: &ConnShared,
        transport: &mut Transport,
        buf: &mut BytesMut,
    ) -> Poll<Event> {
        loop {
            if let Err(()) = self.poll_write(cx, shard, conn, transport) {
                return Poll::Ready(Event::WriteFailed);
            }
            if let Some(origin) = self.paused {
                if !shard.held_full(origin) {
                    self.paused = None;
                    return Poll::Ready(Event::Resume);
                }
            } else {
                match poll_read_some(cx, transport, buf, &shard.scratch) {
                    Poll::Ready(ReadOutcome::Data(n)) => return Poll::Ready(Event::Read(n)),
                    Poll::Ready(ReadOutcome::Closed) => return Poll::Ready(Event::Eof),
                    Poll::Pending => {}
                }
            }
            if conn.is_closing() {
                return Poll::Ready(Event::Close);
            }
            let drained = self.writing.is_empty() && !self.unflushed && conn.out.borrow().is_empty();
            // Acknowledgements waiting for the store go out on this shard,
            // before the connection moves or parks.
            let settled = drained && !shard.store.acks_waiting(conn);
            if let Some(to) = self.move_to {
                if settled {
                    return Poll::Ready(Event::Move(to));
                }
            }
            // Retained messages for a new subscription follow its SUBACK,
            // which may wait for its routes (cluster mode).
            if drained && conn.feeding.get() == Feeding::Ready && !shard.store.acks_held(conn) {
                return Poll::Ready(Event::Feed);
            }
            if conn.park_requested.get() {
                if settled && buf.is_empty() {
                    return Poll::Ready(Event::Park);
                }
                conn.park_requested.set(false);
            }
            // A notification means new bytes to write (or a close): go round.
            if conn.write_signal.poll_wait(cx).is_pending() {
                return Poll::Pending;
            }
        }
    }

    /// Move queued bytes to the socket until it would block. `Err` when
    /// the socket failed.
    fn poll_write(
        &mut self,
        cx: &mut Context<'_>,
        shard: &Shard,
        conn: &ConnShared,
        transport: &mut Transport,
    ) -> Result<(), ()> {
        loop {
            if self.writing.is_empty() {
                let mut out = conn.out.borrow_mut();
                conn.after_disconnect_dropped(&mut out);
                // A CONNACK the store does not cover yet, and what follows
                // it, wait (see `ShardStore::hold_until_durable`); a
                // closing connection writes what it has.
                if out.is_empty() || (conn.held.get() && !conn.is_closing()) {
                    break;
                }
                // Swap the buffers rather than split: each keeps its
                // allocation, so a busy connection allocates nothing per
                // write (`clear` on an emptied, unshared buffer lets the
                // next `reserve` reuse it from the start).
                self.writing.clear();
                std::mem::swap(&mut *out, &mut self.writing);
                if out.capacity() > BUFFER_KEEP {
                    *out = BytesMut::new();
                }
                conn.pending.set(0);
            }
            match Pin::new(&mut *transport).poll_write(cx, &self.writing) {
                Poll::Ready(Ok(n)) if n > 0 => {
                    self.writing.advance(n);
                    self.unflushed = true;
                    conn.active.set(true);
                    shard.metrics.bytes_out.inc_by(n as u64);
                }
                Poll::Ready(_) => return Err(()),
                Poll::Pending => return Ok(()),
            }
        }
        if self.unflushed {
            match Pin::new(&mut *transport).poll_flush(cx) {
                Poll::Ready(Ok(())) => self.unflushed = false,
                Poll::Ready(Err(_)) => return Err(()),
                Poll::Pending => {}
            }
        }
        if self.writing.capacity() > BUFFER_KEEP {
            self.writing = BytesMut::new();
        }
        Ok(())
    }

    /// Write everything queued for a closing connection, and with `acks`
    /// the acknowledgements that wait for the store too, as the store
    /// covers them.
    async fn drain(&mut self, shard: &Shard, conn: &ConnShared, transport: &mut Transport, acks: bool) {
        std::future::poll_fn(|cx| loop {
            if self.poll_write(cx, shard, conn, transport).is_err() {
                return Poll::Ready(());
            }
            let idle = self.writing.is_empty() && !self.unflushed && conn.out.borrow().is_empty();
            if idle && !(acks && shard.store.acks_waiting(conn)) {
                return Poll::Ready(());
            }
            // Woken when the store's acknowledgements (or anything else)
            // are queued: go round.
            if conn.write_signal.poll_wait(cx).is_pending() {
                return Poll::Pending;
            }
        })
        .await
    }
}
