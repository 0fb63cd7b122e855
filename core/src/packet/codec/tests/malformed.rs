//! Every rejection the codec makes, one test each, with the variant and its
//! reason code: 0x81 Malformed Packet, 0x82 Protocol Error, 0x84
//! Unsupported Protocol Version (0x95 is in `incremental`).

use bytes::BytesMut;

use super::{
    assert_malformed, assert_protocol_error, decode_err, decode_one, hex, packet, V3_1, V3_1_1, V5,
};
use crate::packet::codec::DecodeError;
use crate::packet::Packet;

/// A Property Length (one byte: tests stay under 128) and the properties.
fn props(content: &str) -> String {
    format!("{:02x} {content}", hex(content).len())
}

/// An MQTT 5 CONNECT with `flags`, properties `p` and `payload`.
fn connect5(flags: &str, p: &str, payload: &str) -> BytesMut {
    packet(
        0x10,
        &format!("00 04 4d 51 54 54 05 {flags} 00 3c {} {payload}", props(p)),
    )
}

/// An MQTT 3.1.1 CONNECT with `flags` and `payload`.
fn connect311(flags: &str, payload: &str) -> BytesMut {
    packet(
        0x10,
        &format!("00 04 4d 51 54 54 04 {flags} 00 3c {payload}"),
    )
}

/// An MQTT 5 QoS 0 PUBLISH to "a/b" with properties `p`.
fn publish5(p: &str) -> BytesMut {
    packet(0x30, &format!("00 03 61 2f 62 {} 68 69", props(p)))
}

/// An MQTT 5 CONNACK (Success) with properties `p`.
fn connack5(p: &str) -> BytesMut {
    packet(0x20, &format!("00 00 {}", props(p)))
}

/// An MQTT 5 SUBSCRIBE (packet id 1) with properties `p` and `payload`.
fn subscribe5(p: &str, payload: &str) -> BytesMut {
    packet(0x82, &format!("00 01 {} {payload}", props(p)))
}

// Fixed header (MQTT 5 §2.1).

#[test]
fn a_remaining_length_of_five_bytes_is_malformed_without_waiting_for_the_fifth() {
    assert_malformed(BytesMut::from(&hex("30 ff ff ff ff")[..]), V5);
    assert_malformed(BytesMut::from(&hex("30 80 80 80 80")[..]), V5);
}

#[test]
fn packet_type_0_is_malformed() {
    assert_malformed(BytesMut::from(&hex("00 00")[..]), V5);
}

#[test]
fn packet_type_15_is_malformed_before_mqtt5() {
    assert_malformed(BytesMut::from(&hex("f0 00")[..]), V3_1_1);
    assert_malformed(BytesMut::from(&hex("f0 00")[..]), V3_1);
}

#[test]
fn a_first_packet_other_than_connect_is_a_protocol_error_mqtt_3_1_0_1() {
    assert_protocol_error(BytesMut::from(&hex("c0 00")[..]), None);
    assert_protocol_error(packet(0x30, "00 01 61"), None);
}

#[test]
fn wrong_reserved_flags_are_malformed_mqtt_2_1_3_1() {
    assert_malformed(packet(0x41, "00 01"), V5); // PUBACK must be 0000
    assert_malformed(packet(0x60, "00 01"), V5); // PUBREL must be 0010
    assert_malformed(packet(0x80, "00 01 00 01 61 00"), V3_1_1); // SUBSCRIBE must be 0010
    assert_malformed(packet(0xA0, "00 01 00 01 61"), V3_1_1); // UNSUBSCRIBE must be 0010
    assert_malformed(BytesMut::from(&hex("c1 00")[..]), V3_1_1); // PINGREQ must be 0000
    assert_malformed(packet(0x12, "00 04 4d 51 54 54 04 02 00 3c 00 00"), None);
    // CONNECT
}

#[test]
fn publish_with_qos_3_is_malformed_mqtt_3_3_1_4() {
    assert_malformed(packet(0x36, "00 01 61 00 01"), V3_1_1);
}

#[test]
fn publish_with_qos_0_and_dup_is_malformed_mqtt_3_3_1_2() {
    assert_malformed(packet(0x38, "00 01 61"), V3_1_1);
}

// Data representation (MQTT 5 §1.5).

#[test]
fn a_string_that_is_not_utf8_is_malformed_mqtt_1_5_4_1() {
    assert_malformed(packet(0x30, "00 03 61 ff 62"), V3_1_1);
}

#[test]
fn an_encoded_surrogate_is_malformed_mqtt_1_5_4_1() {
    // U+D800 encoded as ED A0 80.
    assert_malformed(packet(0x30, "00 03 ed a0 80"), V5);
}

#[test]
fn an_overlong_encoding_is_malformed_mqtt_1_5_4_1() {
    // U+0000 as the overlong C0 80.
    assert_malformed(packet(0x30, "00 02 c0 80"), V5);
}

#[test]
fn a_string_containing_u0000_is_malformed_mqtt_1_5_4_2() {
    assert_malformed(packet(0x30, "00 03 61 00 62"), V3_1_1);
}

#[test]
fn a_string_running_past_the_packet_is_malformed() {
    assert_malformed(packet(0x30, "00 05 61"), V3_1_1);
}

#[test]
fn a_body_shorter_than_its_packet_identifier_is_malformed() {
    assert_malformed(packet(0x40, "00"), V3_1_1);
}

#[test]
fn trailing_bytes_after_the_last_field_are_malformed() {
    assert_malformed(packet(0xC0, "00"), V5); // PINGREQ has no body
    assert_malformed(packet(0x40, "00 01 00"), V3_1_1); // 3.1.1 PUBACK is 2 bytes
    assert_malformed(packet(0xE0, "00"), V3_1_1); // 3.1.1 DISCONNECT has no body
    assert_malformed(packet(0xB0, "00 01 00"), V3_1_1); // 3.1.1 UNSUBACK is 2 bytes
    assert_malformed(connect311("02", "00 00 ff"), None);
}

#[test]
fn a_variable_byte_integer_of_five_bytes_in_a_property_is_malformed() {
    assert_malformed(subscribe5("0b ff ff ff ff 01", "00 01 61 00"), V5);
}

// Packet identifiers (MQTT 5 §2.2.1).

#[test]
fn packet_identifier_0_is_malformed_mqtt_2_2_1_3() {
    assert_malformed(packet(0x32, "00 01 61 00 00"), V3_1_1); // PUBLISH QoS 1
    assert_malformed(packet(0x40, "00 00"), V5); // PUBACK
    assert_malformed(packet(0x82, "00 00 00 01 61 00"), V3_1_1); // SUBSCRIBE
    assert_malformed(packet(0xA2, "00 00 00 00 01 61"), V5); // UNSUBSCRIBE
}

// Properties (MQTT 5 §2.2.2).

#[test]
fn a_property_not_allowed_on_the_packet_is_malformed() {
    assert_malformed(connect5("02", "23 00 01", "00 00"), None); // Topic Alias on CONNECT
    assert_malformed(publish5("11 00 00 00 0a"), V5); // Session Expiry on PUBLISH
    assert_malformed(connack5("18 00 00 00 01"), V5); // Will Delay on CONNACK
}

#[test]
fn an_unknown_property_identifier_is_malformed() {
    assert_malformed(publish5("04 00"), V5);
    assert_malformed(publish5("7f 00"), V5);
}

#[test]
fn a_property_length_past_the_packet_is_malformed() {
    assert_malformed(packet(0x30, "00 03 61 2f 62 05 01 01"), V5);
}

#[test]
fn a_property_included_twice_is_a_protocol_error() {
    // §3.1.2.11.2: "It is a Protocol Error to include the Session Expiry
    // Interval more than once."
    assert_protocol_error(
        connect5("02", "11 00 00 00 0a 11 00 00 00 0b", "00 00"),
        None,
    );
    assert_protocol_error(publish5("23 00 01 23 00 02"), V5);
}

#[test]
fn a_subscription_identifier_included_twice_in_subscribe_is_a_protocol_error() {
    assert_protocol_error(subscribe5("0b 01 0b 02", "00 01 61 00"), V5);
}

#[test]
fn user_properties_may_repeat_and_keep_their_order_mqtt_3_3_2_18() {
    let p = decode_one(publish5("26 00 01 6b 00 01 31 26 00 01 6b 00 01 32"), V5).unwrap();
    let Packet::Publish(p) = p else {
        panic!("a PUBLISH")
    };
    let values: Vec<&str> = p
        .properties
        .user_properties
        .iter()
        .map(|(_, v)| &v[..])
        .collect();
    assert_eq!(values, ["1", "2"]);
}

#[test]
fn subscription_identifiers_may_repeat_on_publish() {
    let Packet::Publish(p) = decode_one(publish5("0b 01 0b 80 01"), V5).unwrap() else {
        panic!()
    };
    assert_eq!(p.properties.subscription_identifiers, [1, 128]);
}

#[test]
fn subscription_identifier_0_is_a_protocol_error() {
    assert_protocol_error(subscribe5("0b 00", "00 01 61 00"), V5);
}

#[test]
fn receive_maximum_0_is_a_protocol_error() {
    assert_protocol_error(connect5("02", "21 00 00", "00 00"), None);
}

#[test]
fn maximum_packet_size_0_is_a_protocol_error() {
    assert_protocol_error(connect5("02", "27 00 00 00 00", "00 00"), None);
}

#[test]
fn payload_format_indicator_other_than_0_or_1_is_a_protocol_error() {
    assert_protocol_error(publish5("01 02"), V5);
}

#[test]
fn request_problem_information_other_than_0_or_1_is_a_protocol_error() {
    assert_protocol_error(connect5("02", "17 02", "00 00"), None);
}

#[test]
fn request_response_information_other_than_0_or_1_is_a_protocol_error() {
    assert_protocol_error(connect5("02", "19 02", "00 00"), None);
}

#[test]
fn maximum_qos_other_than_0_or_1_is_a_protocol_error() {
    assert_protocol_error(connack5("24 02"), V5);
}

#[test]
fn retain_available_other_than_0_or_1_is_a_protocol_error() {
    assert_protocol_error(connack5("25 02"), V5);
}

#[test]
fn the_available_flags_other_than_0_or_1_are_a_protocol_error() {
    for id in ["28", "29", "2a"] {
        assert_protocol_error(connack5(&format!("{id} 02")), V5);
    }
}

#[test]
fn authentication_data_without_a_method_is_a_protocol_error() {
    assert_protocol_error(connect5("02", "16 00 01 ff", "00 00"), None);
}

#[test]
fn topic_alias_0_is_left_to_the_session_layer() {
    // The session answers DISCONNECT 0x94 (§3.3.2.3.4).
    let Packet::Publish(p) = decode_one(publish5("23 00 00"), V5).unwrap() else {
        panic!()
    };
    assert_eq!(p.properties.topic_alias, Some(0));
}

// CONNECT (MQTT 5 §3.1, 3.1.1 §3.1).

#[test]
fn connect_with_the_reserved_flag_set_is_malformed_mqtt_3_1_2_3() {
    assert_malformed(connect311("03", "00 00"), None);
    assert_malformed(connect5("03", "", "00 00"), None);
}

#[test]
fn connect_with_will_qos_3_is_malformed_mqtt_3_1_2_12() {
    // Will Flag + QoS 3 (bits 3-4).
    assert_malformed(connect311("1e", "00 00 00 01 74 00 00"), None);
}

#[test]
fn will_qos_without_the_will_flag_is_malformed_mqtt_3_1_2_11() {
    assert_malformed(connect311("0a", "00 00"), None);
    assert_malformed(connect5("0a", "", "00 00"), None);
}

#[test]
fn will_retain_without_the_will_flag_is_malformed_mqtt_3_1_2_13() {
    assert_malformed(connect311("22", "00 00"), None);
}

#[test]
fn a_password_without_a_user_name_is_malformed_in_311_mqtt_3_1_2_22() {
    assert_malformed(connect311("42", "00 00 00 01 70"), None);
}

#[test]
fn a_password_without_a_user_name_is_allowed_in_mqtt5() {
    let Packet::Connect(c) = decode_one(connect5("42", "", "00 00 00 01 70"), None).unwrap() else {
        panic!()
    };
    assert_eq!((c.username, c.password.as_deref()), (None, Some(&b"p"[..])));
}

#[test]
fn an_unknown_protocol_name_is_an_unsupported_protocol_version() {
    let e = decode_err(packet(0x10, "00 04 4d 51 54 58 04 02 00 3c 00 00"), None);
    assert_eq!(e, DecodeError::UnsupportedProtocolVersion(4));
    assert_eq!(e.reason_code().0, 0x84);
}

#[test]
fn an_unknown_protocol_level_is_an_unsupported_protocol_version() {
    let e = decode_err(packet(0x10, "00 04 4d 51 54 54 06 02 00 3c 00 00"), None);
    assert_eq!(e, DecodeError::UnsupportedProtocolVersion(6));
    assert_eq!(e.reason_code().0, 0x84);
}

#[test]
fn a_protocol_name_that_does_not_match_the_level_is_unsupported() {
    let mqisdp_4 = packet(0x10, "00 06 4d 51 49 73 64 70 04 02 00 3c 00 00");
    assert_eq!(
        decode_err(mqisdp_4, None),
        DecodeError::UnsupportedProtocolVersion(4)
    );
    let mqtt_3 = packet(0x10, "00 04 4d 51 54 54 03 02 00 3c 00 00");
    assert_eq!(
        decode_err(mqtt_3, None),
        DecodeError::UnsupportedProtocolVersion(3)
    );
}

// Reason codes (MQTT 5 §2.4).

#[test]
fn a_reason_code_not_allowed_on_the_packet_is_malformed() {
    assert_malformed(packet(0x40, "00 01 92"), V5); // PUBACK: 0x92 is PUBREL/PUBCOMP only
    assert_malformed(packet(0x62, "00 01 10"), V5); // PUBREL: 0x10 is PUBACK/PUBREC only
    assert_malformed(packet(0xE0, "05"), V5); // DISCONNECT
    assert_malformed(packet(0x20, "00 01 00"), V5); // CONNACK
    assert_malformed(packet(0x90, "00 01 00 03"), V5); // SUBACK
    assert_malformed(packet(0xB0, "00 01 00 10"), V5); // UNSUBACK
    assert_malformed(packet(0xF0, "01"), V5); // AUTH
}

#[test]
fn a_311_connack_return_code_above_5_is_malformed() {
    assert_malformed(packet(0x20, "00 06"), V3_1_1);
}

#[test]
fn a_311_suback_return_code_other_than_0_1_2_or_0x80_is_malformed_mqtt_3_9_3_2() {
    assert_malformed(packet(0x90, "00 01 03"), V3_1_1);
}

#[test]
fn connack_reserved_flags_are_malformed_mqtt_3_2_2_1() {
    assert_malformed(packet(0x20, "02 00"), V3_1_1);
}

// SUBSCRIBE and UNSUBSCRIBE (MQTT 5 §3.8, §3.10).

#[test]
fn subscription_options_reserved_bits_are_malformed_mqtt_3_8_3_5() {
    assert_malformed(subscribe5("", "00 01 61 40"), V5);
}

#[test]
fn retain_handling_3_is_a_protocol_error() {
    assert_protocol_error(subscribe5("", "00 01 61 30"), V5);
}

#[test]
fn subscription_qos_3_is_malformed() {
    assert_malformed(subscribe5("", "00 01 61 03"), V5);
    assert_malformed(packet(0x82, "00 01 00 01 61 03"), V3_1_1);
}

#[test]
fn subscription_option_bits_above_qos_are_malformed_in_311_mqtt_3_8_3_4() {
    assert_malformed(packet(0x82, "00 01 00 01 61 04"), V3_1_1);
}

#[test]
fn subscribe_without_topic_filters_is_a_protocol_error_mqtt_3_8_3_2() {
    assert_protocol_error(subscribe5("", ""), V5);
    assert_protocol_error(packet(0x82, "00 01"), V3_1_1);
}

#[test]
fn unsubscribe_without_topic_filters_is_a_protocol_error_mqtt_3_10_3_2() {
    assert_protocol_error(packet(0xA2, "00 01 00"), V5);
    assert_protocol_error(packet(0xA2, "00 01"), V3_1_1);
}
