"""A guard against paho-mqtt 2.x re-sending a QoS 2 PUBLISH after its PUBREL.

paho-mqtt (2.2.0, `Client._messages_reconnect_reset_out`) puts every
outgoing QoS 2 message back into a sendable state at each reconnect
*attempt*, before the socket is even opened: a message waiting for its
PUBCOMP (PUBREL sent) becomes "resend PUBREL" — right — but at the next
attempt, when the one before ended without a CONNACK (the broker still
down: connection refused, or the connection dropped before the CONNACK),
"resend PUBREL" is not recognised and becomes "publish", with DUP 0. Once connected, paho sends the PUBLISH again with the same packet
identifier, which MQTT forbids: the sender "MUST NOT re-send the PUBLISH
once it has sent the corresponding PUBREL packet" [MQTT-4.3.3-6]. The
broker released that identifier when the PUBREL came (the receiver treats
any later PUBLISH with it as a new Application Message, MQTT 3.1.1
§4.3.3, MQTT 5 §4.3.3), so the value is stored and delivered a second
time: a duplicate no broker can tell from a new message (Mosquitto 2.0.11
delivers it twice too). Two reconnect attempts in a row without a CONNACK
are enough (a broker down for longer than paho's reconnect delay) when the
broker had taken the PUBREL and its PUBCOMP did not reach paho.

`guard_pubrel_resends(client)` wraps that reset so a message in
"resend PUBREL" stays there (PUBREL is sent again after the CONNACK, as
[MQTT-4.4.0-1] asks), and collects the payloads of the messages it kept
from being published again; with `fix=False` it only collects them (paho
as it is).
"""

import paho.mqtt.client as mqtt


def guard_pubrel_resends(client, fix=True):
    """Install the guard on `client`; returns the set of payloads (bytes) of
    the messages paho would have published again after their PUBREL (with
    `fix`: did not)."""
    caught = set()
    reset = client._messages_reconnect_reset_out

    def guarded_reset():
        # An RLock: the reset below takes it again.
        with client._out_message_mutex:
            for m in client._out_messages.values():
                if m.qos == 2 and m.state == mqtt.mqtt_ms_resend_pubrel:
                    caught.add(bytes(m.payload))
                    if fix:
                        # What the reset turns into "resend PUBREL" again.
                        m.state = mqtt.mqtt_ms_wait_for_pubcomp
            reset()

    client._messages_reconnect_reset_out = guarded_reset
    return caught
