//! rumqttc clients (MQTT 3.1.1 and 5) driven from tests: the event loop runs
//! in a task and forwards what the broker sends, so a test awaits packets
//! with timeouts instead of sleeping.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{timeout, Instant};

/// How long a test waits for a packet it expects.
pub(crate) const WAIT: Duration = Duration::from_secs(5);

/// A unique-enough suffix for client identifiers and topics, so that tests
/// sharing nothing also name nothing alike.
pub(crate) fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

macro_rules! client_wrapper {
    ($name:ident, $module:path, $packet:ty, $publish:ty) => {
        /// A connected rumqttc client and the packets it received.
        pub(crate) struct $name {
            /// The rumqttc handle, for requests the wrapper does not cover.
            pub(crate) client: AsyncClient,
            events: mpsc::UnboundedReceiver<Result<$packet, ConnectionError>>,
            held: VecDeque<$packet>,
            task: JoinHandle<()>,
        }

        // Each version's tests use a different part of the wrapper.
        #[allow(dead_code)]
        impl $name {
            /// Connects with `options` and waits for the CONNACK; returns the
            /// client and the CONNACK.
            ///
            /// # Panics
            ///
            /// The broker refuses or does not answer within [`WAIT`].
            pub(crate) async fn connect_with(options: MqttOptions) -> (Self, $packet) {
                let (client, mut eventloop) = AsyncClient::new(options, 1000);
                let (tx, events) = mpsc::unbounded_channel();
                let task = tokio::spawn(async move {
                    loop {
                        match eventloop.poll().await {
                            Ok(Event::Incoming(packet)) => {
                                if tx.send(Ok(packet)).is_err() {
                                    return;
                                }
                            }
                            Ok(Event::Outgoing(_)) => {}
                            Err(e) => {
                                let _ = tx.send(Err(e));
                                return;
                            }
                        }
                    }
                });
                let mut me = $name {
                    client,
                    events,
                    held: VecDeque::new(),
                    task,
                };
                let connack = me
                    .wait_for("CONNACK", |p| matches!(p, Packet::ConnAck(_)))
                    .await;
                (me, connack)
            }

            /// The next packet that `pick` accepts; publishes skipped on the
            /// way are kept for [`Self::next_publish`].
            ///
            /// # Panics
            ///
            /// The connection ends or nothing matches within [`WAIT`].
            pub(crate) async fn wait_for(
                &mut self,
                what: &str,
                pick: impl Fn(&$packet) -> bool,
            ) -> $packet {
                self.wait_for_within(what, WAIT, pick).await
            }

            /// [`Self::wait_for`] waiting at most `wait`.
            pub(crate) async fn wait_for_within(
                &mut self,
                what: &str,
                wait: Duration,
                pick: impl Fn(&$packet) -> bool,
            ) -> $packet {
                let deadline = Instant::now() + wait;
                loop {
                    match timeout(
                        deadline.saturating_duration_since(Instant::now()),
                        self.events.recv(),
                    )
                    .await
                    {
                        Ok(Some(Ok(packet))) if pick(&packet) => return packet,
                        Ok(Some(Ok(packet @ Packet::Publish(_)))) => self.held.push_back(packet),
                        Ok(Some(Ok(_))) => {}
                        Ok(Some(Err(e))) => panic!("waiting for {what}: connection ended: {e:?}"),
                        Ok(None) => panic!("waiting for {what}: connection ended"),
                        Err(_) => panic!("no {what} within {wait:?}"),
                    }
                }
            }

            /// Subscribes and waits for the SUBACK.
            pub(crate) async fn subscribe(&mut self, filter: &str, qos: QoS) -> $packet {
                self.client
                    .subscribe(filter, qos)
                    .await
                    .expect("subscribe request");
                self.wait_for("SUBACK", |p| matches!(p, Packet::SubAck(_)))
                    .await
            }

            /// The next PUBLISH received within `wait`, if any.
            ///
            /// # Panics
            ///
            /// The connection ends first.
            pub(crate) async fn try_next_publish(&mut self, wait: Duration) -> Option<$publish> {
                if let Some(Packet::Publish(p)) = self.held.pop_front() {
                    return Some(p);
                }
                let deadline = Instant::now() + wait;
                loop {
                    match timeout(
                        deadline.saturating_duration_since(Instant::now()),
                        self.events.recv(),
                    )
                    .await
                    {
                        Ok(Some(Ok(Packet::Publish(p)))) => return Some(p),
                        Ok(Some(Ok(_))) => {}
                        Ok(Some(Err(e))) => panic!("waiting for PUBLISH: connection ended: {e:?}"),
                        Ok(None) => panic!("waiting for PUBLISH: connection ended"),
                        Err(_) => return None,
                    }
                }
            }

            /// The next PUBLISH.
            ///
            /// # Panics
            ///
            /// None arrives within [`WAIT`].
            pub(crate) async fn next_publish(&mut self) -> $publish {
                self.try_next_publish(WAIT)
                    .await
                    .unwrap_or_else(|| panic!("no PUBLISH within {WAIT:?}"))
            }

            /// Asserts that no PUBLISH arrives within `wait`.
            pub(crate) async fn expect_no_publish(&mut self, wait: Duration) {
                if let Some(p) = self.try_next_publish(wait).await {
                    panic!("unexpected PUBLISH {p:?}");
                }
            }

            /// The error that ends the connection, waiting at most `wait`
            /// (other packets are skipped).
            ///
            /// # Panics
            ///
            /// The connection is still up after `wait`.
            pub(crate) async fn closed_with(&mut self, wait: Duration) -> Option<ConnectionError> {
                let deadline = Instant::now() + wait;
                loop {
                    match timeout(
                        deadline.saturating_duration_since(Instant::now()),
                        self.events.recv(),
                    )
                    .await
                    {
                        Ok(Some(Ok(_))) => {}
                        Ok(Some(Err(e))) => return Some(e),
                        Ok(None) => return None,
                        Err(_) => panic!("connection still open after {wait:?}"),
                    }
                }
            }

            /// Sends DISCONNECT and waits for the event loop to finish.
            pub(crate) async fn disconnect(mut self) {
                self.client.disconnect().await.expect("disconnect request");
                let _ = timeout(WAIT, async { while self.events.recv().await.is_some() {} }).await;
                self.task.abort();
            }

            /// Drops the TCP connection without DISCONNECT, like a client
            /// that crashed.
            pub(crate) async fn kill(mut self) {
                self.task.abort();
                // The aborted task drops the event loop and its socket, then
                // the sender: the channel closes.
                let _ = timeout(WAIT, async { while self.events.recv().await.is_some() {} }).await;
            }
        }

        impl Drop for $name {
            fn drop(&mut self) {
                self.task.abort();
            }
        }
    };
}

/// MQTT 3.1.1 clients.
pub(crate) mod v4 {
    use super::*;
    pub(crate) use rumqttc::{
        AsyncClient, ConnectionError, Event, MqttOptions, Packet, Publish, QoS,
    };

    client_wrapper!(Client, rumqttc, Packet, Publish);

    /// Options for `id` on `port`: keep alive 30 s, clean session as given.
    pub(crate) fn options(port: u16, id: &str, clean: bool) -> MqttOptions {
        let mut o = MqttOptions::new(id, "127.0.0.1", port);
        o.set_keep_alive(Duration::from_secs(30))
            .set_clean_session(clean);
        o
    }

    impl Client {
        /// Connects `id` with a clean session.
        pub(crate) async fn connect(port: u16, id: &str) -> Client {
            Client::connect_with(options(port, id, true)).await.0
        }
    }
}

/// MQTT 5 clients.
pub(crate) mod v5 {
    use super::*;
    pub(crate) use rumqttc::v5::mqttbytes::v5::{Packet, Publish};
    pub(crate) use rumqttc::v5::mqttbytes::QoS;
    pub(crate) use rumqttc::v5::{AsyncClient, ConnectionError, Event, MqttOptions, StateError};

    client_wrapper!(Client, rumqttc::v5, Packet, Publish);

    /// Options for `id` on `port`: keep alive 30 s, clean start as given.
    pub(crate) fn options(port: u16, id: &str, clean_start: bool) -> MqttOptions {
        let mut o = MqttOptions::new(id, "127.0.0.1", port);
        o.set_keep_alive(Duration::from_secs(30))
            .set_clean_start(clean_start);
        o
    }

    impl Client {
        /// Connects `id` with clean start.
        pub(crate) async fn connect(port: u16, id: &str) -> Client {
            Client::connect_with(options(port, id, true)).await.0
        }
    }

    /// The DISCONNECT reason code in `err`, if the broker sent one.
    pub(crate) fn server_disconnect_reason(err: &ConnectionError) -> Option<u8> {
        match err {
            ConnectionError::MqttState(StateError::ServerDisconnect { reason_code, .. }) => {
                Some(*reason_code as u8)
            }
            _ => None,
        }
    }
}
