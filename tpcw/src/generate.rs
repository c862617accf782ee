//! The data generator (TPC-W clause 4.7). Every row is a pure function of the scale
//! and its id (its random fields come from a generator seeded by relation and id), so
//! any loader makes any row in any order or thread, and a check can recompute what a
//! row looked like before the run (the initial stock of an item, for instance).
//!
//! Departures: the 92 countries are named `Country-NN` (the specification lists real
//! ones; nothing reads the names), and generated orders belong to customers through a
//! fixed permutation rather than independent draws, so that a customer's latest order
//! (`c_last_o_id`) is known without a pass over the orders.

use crate::schema::*;
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

/// "Now" of the generated data: 2026-01-01, so that runs are reproducible.
pub const NOW: i64 = 1_767_225_600;
const DAY: i64 = 86_400;

const SYLLABLES: [&str; 10] = ["BA", "OG", "AL", "RI", "RE", "SE", "AT", "UL", "IN", "NG"];
const BACKINGS: [&str; 5] = ["HARDBACK", "PAPERBACK", "USED", "AUDIO", "LIMITED-EDITION"];
const SHIP_TYPES: [&str; 6] = ["AIR", "UPS", "FEDEX", "SHIP", "COURIER", "MAIL"];
const STATUSES: [&str; 4] = ["PROCESSING", "SHIPPED", "PENDING", "DENIED"];
const CARD_TYPES: [&str; 5] = ["VISA", "MASTERCARD", "DISCOVER", "AMEX", "DINERS"];

/// A row's own random stream.
pub fn rng_for(rel: Rel, id: u64) -> SmallRng {
    // splitmix64 of (relation, id): neighbouring ids get unrelated streams.
    let mut z = (rel as u64) << 56 ^ id ^ 0x9e37_79b9_7f4a_7c15;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    SmallRng::seed_from_u64(z ^ (z >> 31))
}

/// DigSyl (clause 4.6.2.10): the decimal digits of `n` as syllables.
pub fn dig_syl(n: u64) -> String {
    n.to_string()
        .bytes()
        .map(|d| SYLLABLES[(d - b'0') as usize])
        .collect()
}

/// A-string: random letters and digits, length in `len`.
pub fn a_string(rng: &mut SmallRng, len: std::ops::RangeInclusive<usize>) -> String {
    const CHARS: &[u8; 63] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ";
    random_chars(rng, len, CHARS, 6)
}

/// N-string: random digits.
pub fn n_string(rng: &mut SmallRng, len: std::ops::RangeInclusive<usize>) -> String {
    random_chars(rng, len, b"0123456789", 4)
}

/// A string of a length drawn from `len`, each character uniform over `alphabet`.
/// Characters are cut from each random word `bits` at a time, a field naming no
/// character being skipped (which keeps them uniform), rather than drawn one by one:
/// loading's items are about 1 KB of text each, and a million of them loaded in 4.2 s
/// instead of 4.5 (medians of 3).
fn random_chars(
    rng: &mut SmallRng,
    len: std::ops::RangeInclusive<usize>,
    alphabet: &[u8],
    bits: u32,
) -> String {
    debug_assert!(alphabet.len() <= 1 << bits && alphabet.is_ascii());
    let n = rng.random_range(len);
    let mask = (1u64 << bits) - 1;
    let mut out = String::with_capacity(n);
    while out.len() < n {
        let mut word = rng.next_u64();
        for _ in 0..64 / bits {
            let field = (word & mask) as usize;
            word >>= bits;
            if let Some(&c) = alphabet.get(field) {
                out.push(c as char);
                if out.len() == n {
                    break;
                }
            }
        }
    }
    out
}

pub fn country(co_id: u64) -> Country {
    let mut rng = rng_for(Rel::Country, co_id);
    Country {
        co_id,
        co_name: format!("Country-{co_id:02}"),
        co_exchange: rng.random_range(0.01..100.0),
        co_currency: format!("Currency-{co_id:02}"),
    }
}

pub fn author(a_id: u64) -> Author {
    let mut rng = rng_for(Rel::Author, a_id);
    Author {
        a_id,
        a_fname: a_string(&mut rng, 3..=20),
        a_lname: dig_syl(a_id),
        a_mname: a_string(&mut rng, 1..=20),
        a_dob: rng.random_range(-170 * 365 * DAY..-36 * 365 * DAY),
        a_bio: a_string(&mut rng, 125..=500),
    }
}

/// The item's initial stock (what [`item`] gives `i_stock`), without the strings.
pub fn initial_stock(i_id: u64) -> i32 {
    rng_for(Rel::Item, i_id).random_range(10..=30)
}

fn listing_draws(rng: &mut SmallRng) -> (usize, i64) {
    let subject = rng.random_range(0..SUBJECTS.len());
    (subject, rng.random_range(-40 * 365 * DAY..0) + NOW)
}

/// The generated item's subject (index in [`SUBJECTS`]) and publication date.
pub fn item_listing(i_id: u64) -> (usize, i64) {
    let mut rng = rng_for(Rel::Item, i_id);
    let _stock: i32 = rng.random_range(10..=30);
    listing_draws(&mut rng)
}

/// The generated NEW_PRODUCTS rows, one per subject (computed once per scale).
pub fn new_products(scale: &Scale) -> std::sync::Arc<Vec<NewProducts>> {
    use std::sync::{Arc, Mutex};
    static CACHE: Mutex<Option<(u64, Arc<Vec<NewProducts>>)>> = Mutex::new(None);
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((items, rows)) = cache.as_ref()
        && *items == scale.items
    {
        return rows.clone();
    }
    let mut rows: Vec<NewProducts> = (0..SUBJECTS.len() as u64)
        .map(|np_subject| NewProducts {
            np_subject,
            items: Vec::new(),
        })
        .collect();
    for id in 1..=scale.items {
        let (subject, date) = item_listing(id);
        let row = &mut rows[subject];
        // Cheap pre-filter: most items are older than the 50th newest.
        if row.items.len() < NEW_PRODUCTS || (date, id) > row.items[NEW_PRODUCTS - 1] {
            row.publish(date, id);
        }
    }
    let rows = Arc::new(rows);
    *cache = Some((scale.items, rows.clone()));
    rows
}

pub fn item(scale: &Scale, i_id: u64) -> Item {
    let mut rng = rng_for(Rel::Item, i_id);
    // Drawn first: `initial_stock` and `item_listing` replay these draws alone.
    let i_stock = rng.random_range(10..=30);
    let (subject, i_pub_date) = listing_draws(&mut rng);
    let authors = scale.authors();
    let i_a_id = if i_id <= authors {
        i_id
    } else {
        rng.random_range(1..=authors)
    };
    let i_srp: i64 = rng.random_range(100..=999_999);
    let i_cost = i_srp - i_srp * rng.random_range(0..=50) / 100;
    let mut related = [0u64; 5];
    for r in 0..5 {
        related[r] = loop {
            let candidate = rng.random_range(1..=scale.items);
            if candidate != i_id && !related[..r].contains(&candidate) {
                break candidate;
            }
        };
    }
    let mut item = Item {
        i_id,
        i_stock,
        i_cost,
        i_srp,
        i_a_id,
        i_pub_date,
        i_avail: i_pub_date + rng.random_range(1..=30) * DAY,
        i_page: rng.random_range(20..=9999),
        i_related1: related[0],
        i_related2: related[1],
        i_related3: related[2],
        i_related4: related[3],
        i_related5: related[4],
        i_title: a_string(&mut rng, 14..=60),
        i_publisher: a_string(&mut rng, 14..=60),
        i_subject: SUBJECTS[subject].to_string(),
        i_desc: String::new(),
        i_thumbnail: format!("img{}/thumb_{}.gif", i_id % 100, i_id),
        i_image: format!("img{}/image_{}.gif", i_id % 100, i_id),
        i_isbn: a_string(&mut rng, 13..=13),
        i_backing: BACKINGS[rng.random_range(0..BACKINGS.len())].to_string(),
        i_dimensions: format!(
            "{:.2}x{:.2}x{:.2}",
            rng.random_range(0.01..100.0),
            rng.random_range(0.01..100.0),
            rng.random_range(0.01..100.0)
        ),
    };
    // The description fills the row to `item_bytes` (the spec's 100 to 500 characters
    // when the scale asks for about that much).
    let rest = (scale.item_bytes as usize).saturating_sub(item.encode().len());
    let mut desc = a_string(&mut rng, rest..=rest);
    desc.truncate(rest);
    item.i_desc = desc;
    item
}

/// The multiplier of the order → customer permutation (see the module's docs).
fn order_step(customers: u64) -> u64 {
    [7919u64, 7927, 7933, 7937, 7949]
        .into_iter()
        .find(|p| !customers.is_multiple_of(*p))
        .expect("a customer count divisible by five primes above 7900")
}

/// The customer of generated order `o_id`.
pub fn order_customer(scale: &Scale, o_id: u64) -> u64 {
    let n = scale.customers();
    ((o_id - 1) % n * order_step(n) % n) + 1
}

/// The generated order of customer `c_id`, or 0 (generated orders are fewer than
/// customers, so each customer has at most one).
pub fn customer_order(scale: &Scale, c_id: u64) -> u64 {
    let n = scale.customers();
    let o = (c_id - 1) * inverse(order_step(n), n) % n + 1;
    if o <= scale.orders() { o } else { 0 }
}

/// The inverse of `a` modulo `m` (they are coprime).
fn inverse(a: u64, m: u64) -> u64 {
    let (mut t, mut new_t, mut r, mut new_r) = (0i128, 1i128, m as i128, a as i128);
    while new_r != 0 {
        let q = r / new_r;
        (t, new_t) = (new_t, t - q * new_t);
        (r, new_r) = (new_r, r - q * new_r);
    }
    t.rem_euclid(m as i128) as u64
}

pub fn customer(scale: &Scale, c_id: u64) -> Customer {
    let mut rng = rng_for(Rel::Customer, c_id);
    let uname = dig_syl(c_id);
    let since = NOW - rng.random_range(1..=730) * DAY;
    Customer {
        c_id,
        c_passwd: uname.to_lowercase(),
        c_fname: a_string(&mut rng, 8..=15),
        c_lname: a_string(&mut rng, 8..=15),
        c_addr_id: rng.random_range(1..=scale.addresses()),
        c_phone: n_string(&mut rng, 9..=16),
        c_email: format!(
            "{uname}@{}.com",
            a_string(&mut rng, 2..=9).replace(' ', "x")
        ),
        c_since: since,
        c_last_login: since + rng.random_range(0..=60) * DAY,
        c_login: NOW,
        c_expiration: NOW + 7200,
        c_discount: rng.random_range(0..=50),
        c_balance: 0,
        c_ytd_pmt: rng.random_range(0..=99_999),
        c_birthdate: rng.random_range(-100 * 365 * DAY..-18 * 365 * DAY) + NOW,
        c_data: a_string(&mut rng, 100..=500),
        c_last_o_id: customer_order(scale, c_id),
        c_uname: uname,
    }
}

/// A customer registering during a run (Buy Request, clause 2.7.2.1): id `c_id` (a
/// stream id), user name and password from it, at address `addr_id`, registered at
/// `now`, the rest like generated customer `template`'s.
pub fn registered_customer(
    scale: &Scale,
    c_id: u64,
    addr_id: u64,
    template: u64,
    now: i64,
) -> Customer {
    let uname = dig_syl(c_id);
    Customer {
        c_id,
        c_passwd: uname.to_lowercase(),
        c_email: format!("{uname}@namdb.example"),
        c_uname: uname,
        c_addr_id: addr_id,
        c_since: now,
        c_last_login: now,
        c_login: now,
        c_expiration: now + 7200,
        c_balance: 0,
        c_ytd_pmt: 0,
        c_last_o_id: 0,
        ..customer(scale, template)
    }
}

pub fn address(scale: &Scale, addr_id: u64) -> Address {
    let mut rng = rng_for(Rel::Address, addr_id);
    Address {
        addr_id,
        addr_street1: a_string(&mut rng, 15..=40),
        addr_street2: a_string(&mut rng, 15..=40),
        addr_city: a_string(&mut rng, 4..=30),
        addr_state: a_string(&mut rng, 2..=20),
        addr_zip: a_string(&mut rng, 5..=10),
        addr_co_id: rng.random_range(1..=scale.countries()),
    }
}

/// A generated order with its lines and its credit-card transaction.
pub fn order(scale: &Scale, o_id: u64) -> (Order, Vec<OrderLine>, CcXact) {
    let mut rng = rng_for(Rel::Orders, o_id);
    let n_lines = rng.random_range(1..=5u64);
    let lines: Vec<OrderLine> = (0..n_lines)
        .map(|ol_id| OrderLine {
            ol_id,
            ol_o_id: o_id,
            ol_i_id: rng.random_range(1..=scale.items),
            ol_qty: rng.random_range(1..=300),
            ol_discount: rng.random_range(0..=30),
            ol_comments: a_string(&mut rng, 20..=100),
        })
        .collect();
    // A price per item drawn from its id, less the line's discount (the item's own cost
    // would mean generating its 1 KB row for every line).
    let sub_total: i64 = lines
        .iter()
        .map(|l| {
            let cost = 100 + (l.ol_i_id as i64 * 7919) % 99_900;
            cost * l.ol_qty as i64 * (100 - l.ol_discount as i64) / 100
        })
        .sum();
    let tax = sub_total * 825 / 10_000;
    let o_date = NOW - rng.random_range(1..=60) * DAY;
    let order = Order {
        o_id,
        o_c_id: order_customer(scale, o_id),
        o_date,
        o_sub_total: sub_total,
        o_tax: tax,
        o_total: sub_total + tax + 300 + 100 * n_lines as i64,
        o_ship_type: SHIP_TYPES[rng.random_range(0..SHIP_TYPES.len())].to_string(),
        o_ship_date: o_date + rng.random_range(0..=7) * DAY,
        o_bill_addr_id: rng.random_range(1..=scale.addresses()),
        o_ship_addr_id: rng.random_range(1..=scale.addresses()),
        o_status: STATUSES[rng.random_range(0..STATUSES.len())].to_string(),
        o_num_lines: n_lines as u32,
    };
    let cc = cc_xact(&mut rng, &order, rng_country(scale, o_id));
    (order, lines, cc)
}

fn rng_country(scale: &Scale, o_id: u64) -> u64 {
    rng_for(Rel::CcXacts, o_id).random_range(1..=scale.countries())
}

/// The credit-card transaction paying `order`.
pub fn cc_xact(rng: &mut SmallRng, order: &Order, co_id: u64) -> CcXact {
    CcXact {
        cx_o_id: order.o_id,
        cx_type: CARD_TYPES[rng.random_range(0..CARD_TYPES.len())].to_string(),
        cx_num: n_string(rng, 16..=16),
        cx_name: a_string(rng, 14..=30),
        cx_expire: order.o_date + rng.random_range(10..=730) * DAY,
        cx_auth_id: a_string(rng, 15..=15),
        cx_xact_amt: order.o_total,
        cx_xact_date: order.o_date,
        cx_co_id: co_id,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scale() -> Scale {
        Scale::new(1000, 1, 1024).unwrap()
    }

    #[test]
    fn items_of_the_smallest_size_fill_it_exactly_at_the_largest_scale() {
        let s = Scale::new(10_000_000, 1, Scale::MIN_ITEM_BYTES).unwrap();
        for id in (1..=2000).chain(9_998_000..=10_000_000) {
            let item = item(&s, id);
            assert_eq!(
                item.encode().len(),
                Scale::MIN_ITEM_BYTES as usize,
                "item {id}"
            );
            // Admin Confirm's image names (with a 5-digit stream) come out of the
            // description, which must have room for them.
            assert!(item.i_desc.len() >= 16, "item {id}: {}", item.i_desc.len());
        }
    }

    #[test]
    fn a_registered_customer_with_the_longest_id_fits_its_columns() {
        let s = scale();
        let c = registered_customer(&s, i64::MAX as u64, 7, 1000, NOW);
        assert_eq!(c.c_uname.len(), UNAME_MAX as usize);
        assert_eq!(c.c_passwd.len(), UNAME_MAX as usize);
        assert!(c.c_email.len() <= EMAIL_MAX as usize, "{}", c.c_email);
        assert!(c.encode().len() as u32 <= max_row_bytes(Rel::Customer, &s));
        // The generator's own e-mail domains are no longer than a registration's.
        for id in 1..=2000 {
            let domain = customer(&s, id).c_email.split_once('@').unwrap().1.len();
            assert!(domain <= "namdb.example".len(), "{domain}");
        }
    }

    #[test]
    fn rows_are_deterministic_and_fit_their_blocks() {
        let s = scale();
        for id in [1, 2, 250, 999, 1000] {
            let a = item(&s, id);
            assert_eq!(a, item(&s, id));
            let bytes = a.encode();
            assert_eq!(bytes.len(), 1024, "item rows are padded to item_bytes");
            assert_eq!(Item::decode(&bytes).unwrap(), a);
            assert_eq!(initial_stock(id), a.i_stock);
            let (subject, date) = item_listing(id);
            assert_eq!(
                (SUBJECTS[subject], date),
                (a.i_subject.as_str(), a.i_pub_date)
            );
            assert!((10..=30).contains(&a.i_stock));
            assert!(!a.related().contains(&id));
            assert!(a.i_cost <= a.i_srp && a.i_cost > 0);
        }
        for id in 1..=s.customers() {
            let c = customer(&s, id);
            assert!(c.encode().len() as u32 <= max_row_bytes(Rel::Customer, &s));
            if c.c_last_o_id != 0 {
                assert_eq!(order(&s, c.c_last_o_id).0.o_c_id, id);
            }
        }
        for id in 1..=s.orders() {
            let (o, lines, cc) = order(&s, id);
            assert_eq!(o.o_num_lines as usize, lines.len());
            assert_eq!(cc.cx_xact_amt, o.o_total);
            assert_eq!(customer(&s, o.o_c_id).c_last_o_id, id);
            assert!(o.encode().len() as u32 <= max_row_bytes(Rel::Orders, &s));
            for l in &lines {
                assert!(l.encode().len() as u32 <= max_row_bytes(Rel::OrderLine, &s));
            }
            assert!(cc.encode().len() as u32 <= max_row_bytes(Rel::CcXacts, &s));
        }
        for id in 1..=s.authors() {
            assert!(author(id).encode().len() as u32 <= max_row_bytes(Rel::Author, &s));
        }
        for id in 1..=s.addresses() {
            assert!(address(&s, id).encode().len() as u32 <= max_row_bytes(Rel::Address, &s));
        }
        for id in 1..=s.countries() {
            assert!(country(id).encode().len() as u32 <= max_row_bytes(Rel::Country, &s));
        }
    }

    #[test]
    fn new_products_are_the_newest_of_each_subject() {
        let s = scale();
        let rows = new_products(&s);
        for row in rows.iter() {
            let mut all: Vec<(i64, u64)> = (1..=s.items)
                .map(|id| (id, item_listing(id)))
                .filter(|(_, (subj, _))| *subj as u64 == row.np_subject)
                .map(|(id, (_, date))| (date, id))
                .collect();
            all.sort_by(|a, b| b.cmp(a));
            all.truncate(NEW_PRODUCTS);
            assert_eq!(row.items, all);
        }
    }

    #[test]
    fn every_generated_order_has_exactly_one_customer() {
        let s = scale();
        let mut owners = std::collections::HashSet::new();
        for o in 1..=s.orders() {
            assert!(owners.insert(order_customer(&s, o)));
        }
    }

    #[test]
    fn random_strings_have_their_lengths_and_every_character_about_equally_often() {
        let mut rng = SmallRng::seed_from_u64(7);
        let mut counts = std::collections::HashMap::new();
        let mut lengths = std::collections::HashSet::new();
        for _ in 0..20_000 {
            let s = a_string(&mut rng, 20..=100);
            assert!((20..=100).contains(&s.len()), "{s:?}");
            lengths.insert(s.len());
            for c in s.chars() {
                *counts.entry(c).or_insert(0u64) += 1;
            }
        }
        assert_eq!(lengths.len(), 81, "every length in 20..=100 occurs");
        assert_eq!(
            counts.len(),
            63,
            "letters, digits and the space: {counts:?}"
        );
        let total: u64 = counts.values().sum();
        let expected = total as f64 / 63.0;
        for (c, n) in &counts {
            assert!(c.is_ascii_alphanumeric() || *c == ' ');
            // 1.2 M characters: a character's count is within 2% of its share by
            // about 8 standard deviations, so only a biased generator fails.
            assert!(
                (*n as f64 - expected).abs() < expected * 0.02,
                "{c:?}: {n} of {total}"
            );
        }
        let digits = n_string(&mut rng, 9..=16);
        assert!((9..=16).contains(&digits.len()) && digits.bytes().all(|b| b.is_ascii_digit()));
        let mut seen = std::collections::HashSet::new();
        for _ in 0..1000 {
            seen.extend(n_string(&mut rng, 16..=16).chars());
        }
        assert_eq!(seen.len(), 10);
    }

    #[test]
    fn dig_syl_follows_the_specification() {
        assert_eq!(dig_syl(0), "BA");
        assert_eq!(dig_syl(371), "RIULOG");
    }
}
