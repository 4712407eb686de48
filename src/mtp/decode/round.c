/* The end of a greedy round (round.py `verify` when every row is greedy with no shaping and nothing rides along) as
 * one C call, built and loaded by native.py and called by round_kernel.py: from the verify's argmax, each row's
 * accepted count and next token, the emitted tokens, and the round state's updates (positions, last token, the
 * MTP's slots and pending positions). ~35 tensor operations of a few values each before; integers and copies here,
 * so the state is exactly what the tensor form leaves (tests/test_round_kernel.py). */

#include <stdint.h>
#include <string.h>

typedef struct {
    int64_t B, K, PR, hbytes;     /* rows, drafts per row, pending slots, bytes of one hidden state */
    const int64_t *target, *drafts, *limit; /* [B, K+1] the verify's argmax; [B, K]; [B] */
    const uint8_t* active;        /* [B] bool */
    const char* hidden;           /* [B, K+1] hidden states (hbytes each) */
    int64_t *pos, *last;          /* [B] */
    int64_t *mtp_pos, *pend_next, *pend_n; /* [B], [B, PR], [B]; NULL: no MTP */
    char* pend_h;                 /* [B, PR] hidden states */
    int64_t *keep, *out;          /* out [B]: positions kept; [B, K+2]: the tokens, then n */
} Round;

void accept_greedy(const Round* r) {
    const int64_t K = r->K;
    for (int64_t b = 0; b < r->B; b++) {
        const int64_t* t = r->target + b * (K + 1);
        const int64_t* d = r->drafts + b * K;
        const int64_t lim = r->limit[b] < K ? r->limit[b] : K;
        int64_t n = 0;
        while (n < lim && d[n] == t[n]) n++;
        const int64_t nxt = t[n];
        const int act = r->active[b] != 0;
        if (!act) n = 0;
        const int64_t keep = act ? n + 1 : 0;
        int64_t* tok = r->out + b * (K + 2);
        for (int64_t s = 0; s <= K; s++) tok[s] = s == n ? nxt : (s < K ? d[s] : nxt);
        tok[K + 1] = n;
        r->keep[b] = keep;
        r->pos[b] += keep;
        if (act) r->last[b] = nxt;
        if (!r->mtp_pos || !act) continue;
        int64_t* pn = r->pend_next + b * r->PR;
        char* ph = r->pend_h + b * r->PR * r->hbytes;
        if (K > 0) { /* the MTP read the old pending positions; the kept ones are the next round's */
            r->mtp_pos[b] += r->pend_n[b];
            memcpy(ph, r->hidden + b * (K + 1) * r->hbytes, (size_t)((K + 1) * r->hbytes));
            memcpy(pn, tok, sizeof(int64_t) * (size_t)(K + 1));
            r->pend_n[b] = keep;
        } else { /* nothing was drafted: this position joins the pending ones */
            const int64_t at = r->pend_n[b] < r->PR - 1 ? r->pend_n[b] : r->PR - 1;
            memcpy(ph + at * r->hbytes, r->hidden + b * r->hbytes, (size_t)r->hbytes);
            pn[at] = nxt;
            r->pend_n[b] += 1;
        }
    }
}
