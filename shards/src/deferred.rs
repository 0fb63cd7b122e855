//! The kernel's hold on a connection before the broker accepts it
//! (`TCP_DEFER_ACCEPT`, set on every MQTT listener by
//! `server::bind_reuseport`), and how long a connection it hands over
//! was held: what the pending set (`crate::pending`) needs to tell a
//! storm's connections, whose CONNECTs are on their way, from silent ones.

use std::os::fd::RawFd;
use std::time::Duration;

/// How long the kernel keeps a connection that has sent nothing before
/// the broker accepts it (`TCP_DEFER_ACCEPT` on every MQTT listener,
/// `server::bind_reuseport`): a client speaks first (a CONNECT, a TLS
/// ClientHello, a WebSocket upgrade), so in a reconnect storm a
/// connection is accepted with its first bytes, and a silent one is
/// accepted only after this long (when the kernel sends its SYN-ACK
/// again), already as old as a [`crate::pending::STALL`]. Whole seconds (the option's
/// unit).
pub(crate) const DEFER_ACCEPT: Duration = Duration::from_secs(1);

/// Make the listening `socket` keep a connection out of its accept queue
/// until its first bytes come, for at most [`DEFER_ACCEPT`]
/// (`TCP_DEFER_ACCEPT`).
///
/// # Errors
/// The kernel refused the option.
pub(crate) fn set_defer_accept(socket: &socket2::Socket) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let secs = DEFER_ACCEPT.as_secs() as libc::c_int;
    // SAFETY: a valid socket and a c_int option of the right size.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_DEFER_ACCEPT,
            std::ptr::addr_of!(secs).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The longest the kernel is taken to have held a connection before the
/// broker accepted it: two SYN-ACKs sent again (1 s, then 2 s more). A
/// silent connection is handed over after the first (`DEFER_ACCEPT`),
/// or after the second when the accept queue had no room for it at the
/// first.
pub(crate) const KERNEL_WAIT_MAX: Duration = Duration::from_secs(3);

/// How long the kernel held the socket `fd` before the broker accepted
/// it, at least: each time it sent its SYN-ACK again (`tcpi_total_retrans`,
/// which a connection takes over from its handshake; the broker has sent
/// it nothing else while it is pending) it had waited 1 s, then 2 s more
/// (`TCP_TIMEOUT_INIT` doubling), up to [`KERNEL_WAIT_MAX`]. That happens
/// to a connection silent for [`DEFER_ACCEPT`]. Zero when it cannot tell.
pub(crate) fn kernel_wait(fd: RawFd) -> Duration {
    // SAFETY: a zeroed tcp_info is valid; getsockopt writes at most `len`
    // bytes of it; `fd` is the pending connection's open socket.
    let resent = unsafe {
        let mut info: libc::tcp_info = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        let ok = libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_INFO, std::ptr::addr_of_mut!(info).cast(), &mut len) == 0;
        if ok { info.tcpi_total_retrans } else { 0 }
    };
    match resent {
        0 => Duration::ZERO,
        1 => Duration::from_secs(1),
        _ => KERNEL_WAIT_MAX,
    }
}

/// Whether the kernel held the socket `fd` before the broker accepted it
/// ([`kernel_wait`]): such a connection was opened at least a second
/// before.
pub(crate) fn held_by_kernel(fd: RawFd) -> bool {
    !kernel_wait(fd).is_zero()
}

