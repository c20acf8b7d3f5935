/* jinja_text.c -- UTF-8 code points and Python's character classes for the Jinja
 * interpreter: strings are indexed, sliced and measured in code points as Python does, and
 * strip/split/upper/lower follow Python's definitions (case mappings from utf8proc: the simple
 * one-to-one mappings, so 'ß'.upper() stays 'ß' where Python gives 'SS'). */
#include <string.h>
#include <utf8proc.h>

#include "text/jinja_impl.h"

uint32_t jinja__u8_next(const char *s, size_t len, size_t *i)
{
    const unsigned char *p = (const unsigned char *)s + *i;
    size_t left = len - *i;
    uint32_t c = p[0];
    int n = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    if (n <= 1 || (size_t)n > left) {
        *i += 1;
        return c;
    }
    uint32_t cp = c & (0x7F >> n);
    for (int k = 1; k < n; k++) {
        if ((p[k] & 0xC0) != 0x80) {
            *i += 1;
            return c;
        }
        cp = (cp << 6) | (p[k] & 0x3F);
    }
    *i += (size_t)n;
    return cp;
}

size_t jinja__u8_put(char *dst, uint32_t cp)
{
    unsigned char *d = (unsigned char *)dst;
    if (cp < 0x80) {
        d[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        d[0] = (unsigned char)(0xC0 | (cp >> 6));
        d[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        d[0] = (unsigned char)(0xE0 | (cp >> 12));
        d[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        d[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    d[0] = (unsigned char)(0xF0 | (cp >> 18));
    d[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
    d[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    d[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

size_t jinja__u8_count(const char *s, size_t len)
{
    size_t n = 0, i = 0;
    for (; i + 8 <= len; i += 8) { /* eight ASCII bytes at a time */
        uint64_t w;
        memcpy(&w, s + i, 8);
        if (!(w & 0x8080808080808080ull)) {
            n += 8;
            continue;
        }
        for (size_t k = i; k < i + 8; k++) n += ((unsigned char)s[k] & 0xC0) != 0x80;
    }
    for (; i < len; i++) n += ((unsigned char)s[i] & 0xC0) != 0x80;
    return n;
}

bool jinja__u8_valid(const char *s, size_t len, size_t *bad)
{
    utf8proc_ssize_t i = 0;
    while ((size_t)i < len) {
        if ((size_t)i + 8 <= len) { /* eight ASCII bytes at a time */
            uint64_t w;
            memcpy(&w, s + i, 8);
            if (!(w & 0x8080808080808080ull)) {
                i += 8;
                continue;
            }
        }
        utf8proc_int32_t cp;
        utf8proc_ssize_t n = utf8proc_iterate((const utf8proc_uint8_t *)s + i,
                                              (utf8proc_ssize_t)(len - (size_t)i), &cp);
        if (n <= 0) {
            if (bad) *bad = (size_t)i;
            return false;
        }
        i += n;
    }
    return true;
}

size_t jinja__u8_offset(const jstr *s, size_t i)
{
    if (i >= s->ncp) return s->len;
    if (s->ncp == s->len) return i;
    size_t off = 0;
    for (size_t k = 0; k < i; k++) jinja__u8_next(s->s, s->len, &off);
    return off;
}

bool jinja__is_space(uint32_t cp)
{
    if (cp < 0x80) return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20);
    return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
           cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

uint32_t jinja__cp_upper(uint32_t cp)
{
    if (cp < 0x80) return cp >= 'a' && cp <= 'z' ? cp - 32 : cp;
    return (uint32_t)utf8proc_toupper((utf8proc_int32_t)cp);
}

uint32_t jinja__cp_lower(uint32_t cp)
{
    if (cp < 0x80) return cp >= 'A' && cp <= 'Z' ? cp + 32 : cp;
    return (uint32_t)utf8proc_tolower((utf8proc_int32_t)cp);
}

uint32_t jinja__cp_title(uint32_t cp)
{
    if (cp < 0x80) return jinja__cp_upper(cp);
    return (uint32_t)utf8proc_totitle((utf8proc_int32_t)cp);
}

static utf8proc_category_t cat(uint32_t cp)
{
    return cp > 0x10FFFF ? UTF8PROC_CATEGORY_CN : utf8proc_category((utf8proc_int32_t)cp);
}

bool jinja__cp_is_alpha(uint32_t cp)
{
    if (cp < 0x80) return (cp | 32) >= 'a' && (cp | 32) <= 'z';
    utf8proc_category_t c = cat(cp);
    return c == UTF8PROC_CATEGORY_LU || c == UTF8PROC_CATEGORY_LL || c == UTF8PROC_CATEGORY_LT ||
           c == UTF8PROC_CATEGORY_LM || c == UTF8PROC_CATEGORY_LO;
}

bool jinja__cp_is_upper(uint32_t cp)
{
    if (cp < 0x80) return cp >= 'A' && cp <= 'Z';
    utf8proc_category_t c = cat(cp);
    return c == UTF8PROC_CATEGORY_LU || c == UTF8PROC_CATEGORY_LT;
}

bool jinja__cp_is_lower(uint32_t cp)
{
    if (cp < 0x80) return cp >= 'a' && cp <= 'z';
    return cat(cp) == UTF8PROC_CATEGORY_LL;
}

bool jinja__cp_is_cased(uint32_t cp)
{
    return jinja__cp_is_upper(cp) || jinja__cp_is_lower(cp);
}

bool jinja__cp_is_digit(uint32_t cp)
{
    if (cp < 0x80) return cp >= '0' && cp <= '9';
    return cat(cp) == UTF8PROC_CATEGORY_ND;
}

/* Python's str.isprintable() per character: not Other (Cc, Cf, Cs, Co, Cn) nor a separator
 * other than the ASCII space. */
bool jinja__cp_printable(uint32_t cp)
{
    if (cp < 0x80) return cp >= 0x20 && cp < 0x7F;
    switch (cat(cp)) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
    case UTF8PROC_CATEGORY_ZS: return false;
    default: return true;
    }
}
