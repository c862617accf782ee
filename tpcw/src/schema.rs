//! The TPC-W schema (TPC-W 1.8, clause 1.3): the ten relations, their rows, their
//! keys, and the scale that sizes them.
//!
//! Every relation is keyed by one `u64`. Composite keys are packed: an order line is
//! `o_id * 16 + line` and a cart line `sc_id * 16 + line` (an order or cart has at most
//! [`MAX_LINES`] lines). Money is in cents, dates in seconds since the Unix epoch.
//!
//! Two columns are ours: `o_num_lines` (so that reading an order's lines needs no
//! search) and `c_last_o_id` (the customer's latest order, which Order Inquiry needs and
//! which TPC-W finds with `MAX(o_id) … WHERE o_c_id = ?`, an index this store does not
//! keep).

use crate::codec::{CodecError, Dec, Enc};
use std::ops::RangeInclusive;

/// Lines of an order or a shopping cart, at most.
pub const MAX_LINES: u64 = 16;

/// The relations, in the order their tables are created.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Rel {
    Country,
    Author,
    Item,
    Customer,
    Address,
    Orders,
    OrderLine,
    CcXacts,
    ShoppingCart,
    ShoppingCartLine,
    /// Ours: per subject, the newest items ([`NewProducts`]), so that New Products and
    /// Search by subject need no scan of ITEM.
    NewProducts,
}

impl Rel {
    pub const ALL: [Rel; 11] = [
        Rel::Country,
        Rel::Author,
        Rel::Item,
        Rel::Customer,
        Rel::Address,
        Rel::Orders,
        Rel::OrderLine,
        Rel::CcXacts,
        Rel::ShoppingCart,
        Rel::ShoppingCartLine,
        Rel::NewProducts,
    ];

    /// The table name (as in the specification, lower case).
    pub fn name(self) -> &'static str {
        match self {
            Rel::Country => "country",
            Rel::Author => "author",
            Rel::Item => "item",
            Rel::Customer => "customer",
            Rel::Address => "address",
            Rel::Orders => "orders",
            Rel::OrderLine => "order_line",
            Rel::CcXacts => "cc_xacts",
            Rel::ShoppingCart => "shopping_cart",
            Rel::ShoppingCartLine => "shopping_cart_line",
            Rel::NewProducts => "new_products",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

pub fn order_line_key(o_id: u64, line: u64) -> u64 {
    o_id * MAX_LINES + line
}

pub fn cart_line_key(sc_id: u64, line: u64) -> u64 {
    sc_id * MAX_LINES + line
}

/// Ids made during a run come from per-client streams so that clients never contend
/// for a counter: id `(stream + 1) << STREAM_SHIFT | seq`. Stream 0 is the generator's
/// (ids `1..=n`). A stream's ids are dense: a client advances its sequence only when
/// the transaction that used it commits.
pub const STREAM_SHIFT: u32 = 36;

pub fn stream_id(stream: u64, seq: u64) -> u64 {
    ((stream + 1) << STREAM_SHIFT) | seq
}

/// The scale of a database (clause 4.3): `items` (NUM_ITEMS) and `ebs` (NUM_EBS, the
/// emulated browsers the population is sized for).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scale {
    pub items: u64,
    pub ebs: u64,
    /// Encoded bytes of an ITEM row (the description is padded to reach it); the paper
    /// uses about 1 KB.
    pub item_bytes: u32,
}

impl Scale {
    /// An ITEM row's columns other than the description take up to about 360 bytes
    /// (two 60-character strings, file names with 8-digit ids, and Admin Confirm's
    /// longer image names): below this the generator could not reach `item_bytes`,
    /// and 256 failed every run with "value exceeds the table's 256".
    pub const MIN_ITEM_BYTES: u32 = 512;
    pub const MAX_ITEM_BYTES: u32 = 16_384;
    /// The NUM_ITEMS and NUM_EBS this implementation takes.
    pub const ITEMS: RangeInclusive<u64> = 1_000..=10_000_000;
    pub const EBS: RangeInclusive<u64> = 1..=100_000;

    pub fn new(items: u64, ebs: u64, item_bytes: u32) -> Result<Scale, String> {
        if !Self::ITEMS.contains(&items) {
            return Err(format!(
                "NUM_ITEMS must be between {} and {}, got {items}",
                Self::ITEMS.start(),
                Self::ITEMS.end()
            ));
        }
        if !Self::EBS.contains(&ebs) {
            return Err(format!(
                "NUM_EBS must be between {} and {}, got {ebs}",
                Self::EBS.start(),
                Self::EBS.end()
            ));
        }
        if !(Self::MIN_ITEM_BYTES..=Self::MAX_ITEM_BYTES).contains(&item_bytes) {
            return Err(format!(
                "item bytes must be between {} and {}, got {item_bytes}",
                Self::MIN_ITEM_BYTES,
                Self::MAX_ITEM_BYTES
            ));
        }
        Ok(Scale {
            items,
            ebs,
            item_bytes,
        })
    }
    pub fn countries(&self) -> u64 {
        92
    }
    pub fn authors(&self) -> u64 {
        (self.items / 4).max(1)
    }
    pub fn customers(&self) -> u64 {
        2880 * self.ebs
    }
    pub fn addresses(&self) -> u64 {
        2 * self.customers()
    }
    pub fn orders(&self) -> u64 {
        self.customers() * 9 / 10
    }
    pub fn rows(&self, rel: Rel) -> u64 {
        match rel {
            Rel::Country => self.countries(),
            Rel::Author => self.authors(),
            Rel::Item => self.items,
            Rel::Customer => self.customers(),
            Rel::Address => self.addresses(),
            Rel::Orders | Rel::CcXacts => self.orders(),
            // Not known before generation; the generator makes 1 to 5 per order.
            Rel::OrderLine => self.orders() * 3,
            Rel::ShoppingCart | Rel::ShoppingCartLine => 0,
            Rel::NewProducts => SUBJECTS.len() as u64,
        }
    }
}

/// The subjects of clause 4.6.2.13, in order.
pub const SUBJECTS: [&str; 24] = [
    "ARTS",
    "BIOGRAPHIES",
    "BUSINESS",
    "CHILDREN",
    "COMPUTERS",
    "COOKING",
    "HEALTH",
    "HISTORY",
    "HOME",
    "HUMOR",
    "LITERATURE",
    "MYSTERY",
    "NON-FICTION",
    "PARENTING",
    "POLITICS",
    "REFERENCE",
    "RELIGION",
    "ROMANCE",
    "SELF-HELP",
    "SCIENCE-NATURE",
    "SCIENCE-FICTION",
    "SPORTS",
    "YOUTH",
    "TRAVEL",
];

macro_rules! row_codec {
    ($ty:ident, $what:literal, { $($field:ident : $kind:ident),* $(,)? }) => {
        impl $ty {
            pub fn encode(&self) -> Vec<u8> {
                let mut e = Enc::with_capacity(64);
                $( row_codec!(@enc e, self.$field, $kind); )*
                e.finish()
            }
            pub fn decode(bytes: &[u8]) -> Result<$ty, CodecError> {
                let mut d = Dec::new($what, bytes);
                let row = $ty { $( $field: row_codec!(@dec d, $kind), )* };
                d.end()?;
                Ok(row)
            }
        }
    };
    (@enc $e:ident, $v:expr, str) => { $e.str(&$v); };
    (@enc $e:ident, $v:expr, $kind:ident) => { $e.$kind($v); };
    (@dec $d:ident, $kind:ident) => { $d.$kind()? };
}

#[derive(Clone, Debug, PartialEq)]
pub struct Country {
    pub co_id: u64,
    pub co_name: String,
    pub co_exchange: f64,
    pub co_currency: String,
}
row_codec!(Country, "country", { co_id: u64, co_name: str, co_exchange: f64, co_currency: str });

#[derive(Clone, Debug, PartialEq)]
pub struct Author {
    pub a_id: u64,
    pub a_fname: String,
    pub a_lname: String,
    pub a_mname: String,
    pub a_dob: i64,
    pub a_bio: String,
}
row_codec!(Author, "author", {
    a_id: u64, a_fname: str, a_lname: str, a_mname: str, a_dob: i64, a_bio: str,
});

/// An ITEM row. The numeric columns come first at fixed offsets, so that the hot path
/// (checkout, Buy Confirm) reads the cost and changes the stock without decoding the
/// strings ([`Item::stock_of`], [`Item::set_stock`], [`Item::cost_of`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Item {
    pub i_id: u64,
    pub i_stock: i32,
    pub i_cost: i64,
    pub i_srp: i64,
    pub i_a_id: u64,
    pub i_pub_date: i64,
    pub i_avail: i64,
    pub i_page: u32,
    pub i_related1: u64,
    pub i_related2: u64,
    pub i_related3: u64,
    pub i_related4: u64,
    pub i_related5: u64,
    pub i_title: String,
    pub i_publisher: String,
    pub i_subject: String,
    pub i_desc: String,
    pub i_thumbnail: String,
    pub i_image: String,
    pub i_isbn: String,
    pub i_backing: String,
    pub i_dimensions: String,
}
row_codec!(Item, "item", {
    i_id: u64, i_stock: i32, i_cost: i64, i_srp: i64, i_a_id: u64, i_pub_date: i64,
    i_avail: i64, i_page: u32, i_related1: u64, i_related2: u64, i_related3: u64,
    i_related4: u64, i_related5: u64, i_title: str, i_publisher: str, i_subject: str,
    i_desc: str, i_thumbnail: str, i_image: str, i_isbn: str, i_backing: str,
    i_dimensions: str,
});

impl Item {
    const STOCK_AT: usize = 8;
    const COST_AT: usize = 12;
    /// Bytes of the fixed-offset prefix.
    const FIXED: usize = 20;

    fn fixed(bytes: &[u8]) -> Result<(), CodecError> {
        if bytes.len() < Self::FIXED {
            return Err(CodecError::Truncated {
                what: "item",
                at: bytes.len(),
            });
        }
        Ok(())
    }
    pub fn stock_of(bytes: &[u8]) -> Result<i32, CodecError> {
        Self::fixed(bytes)?;
        let mut a = [0u8; 4];
        a.copy_from_slice(&bytes[Self::STOCK_AT..Self::STOCK_AT + 4]);
        Ok(i32::from_le_bytes(a))
    }
    pub fn cost_of(bytes: &[u8]) -> Result<i64, CodecError> {
        Self::fixed(bytes)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(&bytes[Self::COST_AT..Self::COST_AT + 8]);
        Ok(i64::from_le_bytes(a))
    }
    pub fn set_stock(bytes: &mut [u8], stock: i32) -> Result<(), CodecError> {
        Self::fixed(bytes)?;
        bytes[Self::STOCK_AT..Self::STOCK_AT + 4].copy_from_slice(&stock.to_le_bytes());
        Ok(())
    }
    pub fn related(&self) -> [u64; 5] {
        [
            self.i_related1,
            self.i_related2,
            self.i_related3,
            self.i_related4,
            self.i_related5,
        ]
    }
}

/// The stock rule of Buy Confirm (clause 2.7.3.3): subtract the quantity; if fewer than
/// 10 would remain, add 21. Returns the new stock and whether it restocked.
pub fn sell(stock: i32, qty: i32) -> (i32, bool) {
    if stock - qty < 10 {
        (stock - qty + 21, true)
    } else {
        (stock - qty, false)
    }
}

/// Longest C_UNAME and C_PASSWD: both are DigSyl(C_ID) (clause 4.7.1), two letters a
/// digit. The specification's 20 fits the ids it generates, but a customer registered
/// during a run has a stream id ([`stream_id`]), which may have as many digits as any
/// key below 2^63 (PostgreSQL's BIGINT): 19.
pub const UNAME_MAX: u32 = 38;
/// Longest C_EMAIL: the user name, `@` and a domain of at most 13 letters (the
/// generator's 2 to 9 and `.com`, or a registration's `namdb.example`).
pub const EMAIL_MAX: u32 = UNAME_MAX + 14;

#[derive(Clone, Debug, PartialEq)]
pub struct Customer {
    pub c_id: u64,
    pub c_uname: String,
    pub c_passwd: String,
    pub c_fname: String,
    pub c_lname: String,
    pub c_addr_id: u64,
    pub c_phone: String,
    pub c_email: String,
    pub c_since: i64,
    pub c_last_login: i64,
    pub c_login: i64,
    pub c_expiration: i64,
    pub c_discount: u32,
    pub c_balance: i64,
    pub c_ytd_pmt: i64,
    pub c_birthdate: i64,
    pub c_data: String,
    pub c_last_o_id: u64,
}
row_codec!(Customer, "customer", {
    c_id: u64, c_uname: str, c_passwd: str, c_fname: str, c_lname: str, c_addr_id: u64,
    c_phone: str, c_email: str, c_since: i64, c_last_login: i64, c_login: i64,
    c_expiration: i64, c_discount: u32, c_balance: i64, c_ytd_pmt: i64, c_birthdate: i64,
    c_data: str, c_last_o_id: u64,
});

#[derive(Clone, Debug, PartialEq)]
pub struct Address {
    pub addr_id: u64,
    pub addr_street1: String,
    pub addr_street2: String,
    pub addr_city: String,
    pub addr_state: String,
    pub addr_zip: String,
    pub addr_co_id: u64,
}
row_codec!(Address, "address", {
    addr_id: u64, addr_street1: str, addr_street2: str, addr_city: str, addr_state: str,
    addr_zip: str, addr_co_id: u64,
});

#[derive(Clone, Debug, PartialEq)]
pub struct Order {
    pub o_id: u64,
    pub o_c_id: u64,
    pub o_date: i64,
    pub o_sub_total: i64,
    pub o_tax: i64,
    pub o_total: i64,
    pub o_ship_type: String,
    pub o_ship_date: i64,
    pub o_bill_addr_id: u64,
    pub o_ship_addr_id: u64,
    pub o_status: String,
    pub o_num_lines: u32,
}
row_codec!(Order, "orders", {
    o_id: u64, o_c_id: u64, o_date: i64, o_sub_total: i64, o_tax: i64, o_total: i64,
    o_ship_type: str, o_ship_date: i64, o_bill_addr_id: u64, o_ship_addr_id: u64,
    o_status: str, o_num_lines: u32,
});

#[derive(Clone, Debug, PartialEq)]
pub struct OrderLine {
    pub ol_id: u64,
    pub ol_o_id: u64,
    pub ol_i_id: u64,
    pub ol_qty: u32,
    pub ol_discount: u32,
    pub ol_comments: String,
}
row_codec!(OrderLine, "order_line", {
    ol_id: u64, ol_o_id: u64, ol_i_id: u64, ol_qty: u32, ol_discount: u32,
    ol_comments: str,
});

#[derive(Clone, Debug, PartialEq)]
pub struct CcXact {
    pub cx_o_id: u64,
    pub cx_type: String,
    pub cx_num: String,
    pub cx_name: String,
    pub cx_expire: i64,
    pub cx_auth_id: String,
    pub cx_xact_amt: i64,
    pub cx_xact_date: i64,
    pub cx_co_id: u64,
}
row_codec!(CcXact, "cc_xacts", {
    cx_o_id: u64, cx_type: str, cx_num: str, cx_name: str, cx_expire: i64,
    cx_auth_id: str, cx_xact_amt: i64, cx_xact_date: i64, cx_co_id: u64,
});

/// A cart: its lines are `cart_line_key(sc_id, 0..sc_num_lines)`.
#[derive(Clone, Debug, PartialEq)]
pub struct ShoppingCart {
    pub sc_id: u64,
    pub sc_time: i64,
    pub sc_num_lines: u32,
}
row_codec!(ShoppingCart, "shopping_cart", { sc_id: u64, sc_time: i64, sc_num_lines: u32 });

#[derive(Clone, Debug, PartialEq)]
pub struct ShoppingCartLine {
    pub scl_sc_id: u64,
    pub scl_qty: u32,
    pub scl_i_id: u64,
}
row_codec!(ShoppingCartLine, "shopping_cart_line", {
    scl_sc_id: u64, scl_qty: u32, scl_i_id: u64,
});

/// Items New Products shows (clause 2.10.1: the 50 newest of a subject).
pub const NEW_PRODUCTS: usize = 50;

/// Ours: the newest items of subject `np_subject` (its index in [`SUBJECTS`]), newest
/// first, as (publication date, item id); ties by id. Kept exact because the only
/// change to a publication date (Admin Confirm) makes it newer.
#[derive(Clone, Debug, PartialEq)]
pub struct NewProducts {
    pub np_subject: u64,
    pub items: Vec<(i64, u64)>,
}

impl NewProducts {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::with_capacity(12 + 16 * self.items.len());
        e.u64(self.np_subject).u32(self.items.len() as u32);
        for &(date, id) in &self.items {
            e.i64(date).u64(id);
        }
        e.finish()
    }
    pub fn decode(bytes: &[u8]) -> Result<NewProducts, CodecError> {
        let mut d = Dec::new("new_products", bytes);
        let np_subject = d.u64()?;
        let n = d.u32()? as usize;
        let mut items = Vec::with_capacity(n.min(NEW_PRODUCTS));
        for _ in 0..n {
            items.push((d.i64()?, d.u64()?));
        }
        d.end()?;
        Ok(NewProducts { np_subject, items })
    }
    /// Records that item `id` was published at `date` (it may be listed already).
    pub fn publish(&mut self, date: i64, id: u64) {
        self.items.retain(|&(_, i)| i != id);
        let at = self.items.partition_point(|&(d, i)| (d, i) > (date, id));
        self.items.insert(at, (date, id));
        self.items.truncate(NEW_PRODUCTS);
    }
}

pub fn subject_index(subject: &str) -> Option<u64> {
    SUBJECTS
        .iter()
        .position(|s| *s == subject)
        .map(|i| i as u64)
}

/// The largest encoded row of each relation, for sizing fixed-size record blocks:
/// every string at its specified maximum (ITEM at `scale.item_bytes`, which the
/// generator never exceeds).
pub fn max_row_bytes(rel: Rel, scale: &Scale) -> u32 {
    // 2 bytes of length per string, 8 per number unless narrower.
    let s = |max: u32| 2 + max;
    match rel {
        Rel::Country => 8 + s(50) + 8 + s(18),
        Rel::Author => 8 + s(20) + s(20) + s(20) + 8 + s(500),
        Rel::Item => scale.item_bytes,
        Rel::Customer => {
            8 + s(UNAME_MAX)
                + s(UNAME_MAX)
                + s(15)
                + s(15)
                + 8
                + s(16)
                + s(EMAIL_MAX)
                + 8 * 4
                + 4
                + 8 * 3
                + s(500)
                + 8
        }
        Rel::Address => 8 + s(40) + s(40) + s(30) + s(20) + s(10) + 8,
        Rel::Orders => 8 * 6 + s(10) + 8 * 3 + s(15) + 4,
        Rel::OrderLine => 8 * 3 + 4 + 4 + s(100),
        Rel::CcXacts => 8 + s(10) + s(20) + s(30) + 8 + s(15) + 8 + 8 + 8,
        Rel::ShoppingCart => 8 + 8 + 4,
        Rel::ShoppingCartLine => 8 + 4 + 8,
        Rel::NewProducts => 8 + 4 + NEW_PRODUCTS as u32 * 16,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stock_rule_matches_the_specification() {
        assert_eq!(sell(30, 5), (25, false));
        assert_eq!(sell(15, 5), (10, false));
        assert_eq!(sell(14, 5), (30, true));
        assert_eq!(sell(10, 10), (21, true));
    }

    #[test]
    fn item_fast_accessors_agree_with_decode() {
        let item = Item {
            i_id: 9,
            i_stock: 17,
            i_cost: 1234,
            i_srp: 2000,
            i_a_id: 3,
            i_pub_date: 5,
            i_avail: 6,
            i_page: 7,
            i_related1: 1,
            i_related2: 2,
            i_related3: 3,
            i_related4: 4,
            i_related5: 5,
            i_title: "t".into(),
            i_publisher: "p".into(),
            i_subject: "ARTS".into(),
            i_desc: "d".into(),
            i_thumbnail: "th".into(),
            i_image: "im".into(),
            i_isbn: "isbn".into(),
            i_backing: "b".into(),
            i_dimensions: "dim".into(),
        };
        let mut bytes = item.encode();
        assert_eq!(Item::stock_of(&bytes).unwrap(), 17);
        assert_eq!(Item::cost_of(&bytes).unwrap(), 1234);
        Item::set_stock(&mut bytes, 40).unwrap();
        let back = Item::decode(&bytes).unwrap();
        assert_eq!(back.i_stock, 40);
        assert_eq!(
            Item {
                i_stock: 17,
                ..back
            },
            item
        );
        assert!(Item::stock_of(&bytes[..10]).is_err());
        assert!(Item::decode(&bytes[..bytes.len() - 1]).is_err());
    }

    #[test]
    fn new_products_keep_the_newest_fifty() {
        let mut np = NewProducts {
            np_subject: 3,
            items: Vec::new(),
        };
        for id in 1..=80u64 {
            np.publish((id % 7) as i64, id);
        }
        assert_eq!(np.items.len(), NEW_PRODUCTS);
        assert!(np.items.windows(2).all(|w| w[0] > w[1]));
        // Republishing an item moves it, never duplicates it.
        np.publish(100, np.items[30].1);
        assert_eq!(np.items.len(), NEW_PRODUCTS);
        assert_eq!(np.items[0].0, 100);
        let back = NewProducts::decode(&np.encode()).unwrap();
        assert_eq!(back, np);
        assert!(NewProducts::decode(&np.encode()[..20]).is_err());
    }

    #[test]
    fn keys_do_not_collide() {
        assert_ne!(order_line_key(1, 15), order_line_key(2, 0));
        assert!(stream_id(0, 0) > 10_000_000);
        assert!(stream_id(1, 0) > stream_id(0, (1 << STREAM_SHIFT) - 1));
        // Order-line keys of any stream id still fit a u64.
        assert!(stream_id(1 << 20, 1 << 30).checked_mul(MAX_LINES).is_some());
    }

    #[test]
    fn scale_is_checked() {
        assert!(Scale::new(999, 1, 1024).is_err());
        assert!(Scale::new(1000, 0, 1024).is_err());
        assert!(Scale::new(1000, 1, 100).is_err());
        let s = Scale::new(100_000, 10, 1024).unwrap();
        assert_eq!(s.customers(), 28_800);
        assert_eq!(s.orders(), 25_920);
        assert_eq!(s.authors(), 25_000);
    }
}
