-- Fencing in a database: the row remembers the highest token that wrote it, and every write
-- is a conditional UPDATE that refuses a lower one. The database is the protected resource, so
-- a holder that wakes up late can do no harm, whatever it believes.
CREATE TABLE inventory (
    item          text PRIMARY KEY,
    left_in_stock integer NOT NULL CHECK (left_in_stock >= 0),
    reserved_by   text[] NOT NULL DEFAULT '{}',
    lease_uid     text NOT NULL,   -- the FencedLease (incarnation) whose tokens guard this row
    fence_token   bigint NOT NULL DEFAULT 0
);

-- Writes what the caller computed from its read (as the naive app in the articles does: no
-- compare-and-set on the data), guarded only by the fencing token: the row is written if the
-- token belongs to the guarding lease and is at least the highest seen. Returns false when
-- refused. After deleting and re-creating the FencedLease, re-key the row on purpose:
--   UPDATE inventory SET lease_uid = '<new uid>', fence_token = 0 WHERE item = '...';
CREATE FUNCTION fenced_write(p_item text, p_left integer, p_reserved_by text[],
                             p_token bigint, p_lease_uid text)
RETURNS boolean LANGUAGE sql AS $$
    WITH done AS (
        UPDATE inventory
           SET left_in_stock = p_left,
               reserved_by   = p_reserved_by,
               fence_token   = p_token
         WHERE item = p_item
           AND lease_uid = p_lease_uid
           AND fence_token <= p_token
        RETURNING 1)
    SELECT count(*) = 1 FROM done
$$;
