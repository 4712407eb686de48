/* The end of a greedy round (round.py `verify` when every row is greedy with no shaping and nothing rides along) as
 * one C call, built and loaded by native.py and called by round_kernel.py: from the verify's argmax, each row's
 * accepted count and next token, the emitted tokens, and the round state's updates (positions, last token, the
 * MTP's slots and pending positions, the tokens seen). ~35 tensor operations of a few values each before; integers
 * and copies here, so the state is exactly what the tensor form leaves (tests/test_round_kernel.py). */

#define _POSIX_C_SOURCE 199309L /* clock_gettime */
#include <stdint.h>
#include <string.h>
#include <time.h>

typedef struct {
    int64_t B, K, PR, hbytes;     /* rows, drafts per row, pending slots, bytes of one hidden state */
    const int64_t *target, *drafts, *limit; /* [B, K+1] the verify's argmax; [B, K]; [B] */
    const uint8_t* active;        /* [B] bool */
    const char* hidden;           /* [B, K+1] hidden states (hbytes each) */
    int64_t *pos, *last;          /* [B] */
    int64_t *mtp_pos, *pend_next, *pend_n; /* [B], [B, PR], [B]; NULL: no MTP */
    char* pend_h;                 /* [B, PR] hidden states */
    int64_t *keep, *out;          /* out [B]: positions kept; [B, K+2]: the tokens, then n */
    uint8_t* seen;                /* [B, V] bool: the tokens each row has seen (the repetition penalty's), or NULL */
    int64_t V;
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
        if (r->seen && act)
            for (int64_t s = 0; s <= n; s++) r->seen[b * r->V + tok[s]] = 1;
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

/* A whole greedy round as one call (round_kernel.py `greedy_round`), where the model runs its forwards as C programs
 * (a Qwen3.5 dense backbone and MTP on qmatmul.c layers: model/step.c). The same pieces in the same order as
 * round.py's `draft` and `verify`, so the same bits: the draft chain (qwen35_draft, K > 0), the verify's ids
 * [last, d_1..d_K] and positions pos + 0..K with their rotary rows, the verify forward with the head and argmax
 * (qwen35_verify; with `pick`, sampled rows take the token their noise picks: a rule that is greedy over picked
 * tokens, as seeded rows' and a plain step's are), `accept_greedy` above, and the DeltaNet layers' keep
 * (deltanet_keep_layers; none where the forward updated them in place). What the model's programs read (their
 * structs, layers, the buffers ids ... hidden) is opaque here: round.c fills the buffers, the programs read them.
 * 0, or a program's status with `stage` saying which (1 the draft, 2 the verify; -5 at stage 2: a position past the
 * rotary table, the verify not run). */
typedef int (*draft_fn)(const void*, const void*, const void*, int64_t, int);
typedef int (*verify_fn)(const void*, const void*, const void*, int64_t, const void*, void*, int64_t*, const void*, int);
typedef void (*keep_fn)(int64_t, const void*, const int64_t*, int);

typedef struct {
    Round acc;                  /* accept_greedy's: target and hidden are the verify's outputs, drafts the chain's */
    int64_t R, P;               /* rotary dims, rotary table rows */
    int64_t *ids, *index;       /* [B, K+1]: the verify's tokens and positions (its program reads them) */
    uint16_t *cos, *sin;        /* [B*(K+1), R]: their rotary rows (likewise) */
    const uint16_t *table_cos, *table_sin; /* [P, R] */
    const void* kernels;        /* the programs' kernel table */
    verify_fn verify;
    const void *step, *layers;  /* the verify program's forward and layers */
    int64_t L;
    const void *head;
    void* logits;               /* [B*(K+1), V] bf16 scratch */
    draft_fn draft;
    const void *draft_args, *draft_layers; /* (writes acc.drafts) */
    int64_t draft_L;
    keep_fn keep;
    const void* keep_layers;
    int64_t keep_L;             /* 0: nothing to keep (updated in place) */
    int64_t nth, stage, draft_ns, round_ns; /* threads; out: the failing stage, nanoseconds in the draft chain and in all */
    const void* pick;           /* the verify's sampling rule (the rows' temperatures, top-k, noise), or NULL: argmax */
} GreedyRound;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

int greedy_round(GreedyRound* g) {
    const Round* r = &g->acc;
    const int64_t B = r->B, K = r->K, T = K + 1, R = g->R;
    const int nth = (int)g->nth;
    const int64_t t0 = now_ns();
    g->stage = 1;
    if (K > 0) {
        const int status = g->draft(g->kernels, g->draft_args, g->draft_layers, g->draft_L, nth);
        if (status) return status;
    }
    g->draft_ns = now_ns() - t0;
    g->stage = 2;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            const int64_t m = b * T + t, at = r->pos[b] + t;
            if (at < 0 || at >= g->P) return -5;
            g->ids[m] = t == 0 ? r->last[b] : r->drafts[b * K + t - 1];
            g->index[m] = at;
            memcpy(g->cos + m * R, g->table_cos + at * R, sizeof(uint16_t) * (size_t)R);
            memcpy(g->sin + m * R, g->table_sin + at * R, sizeof(uint16_t) * (size_t)R);
        }
    const int status = g->verify(g->kernels, g->step, g->layers, g->L, g->head, g->logits, (int64_t*)r->target, g->pick,
                                 nth);
    if (status) return status;
    g->stage = 3;
    accept_greedy(r);
    if (g->keep_L) g->keep(g->keep_L, g->keep_layers, r->keep, nth);
    g->stage = 0;
    g->round_ns = now_ns() - t0;
    return 0;
}

/* `greedy_round` for one row (B = 1) up to `rounds` times back to back, doing between rounds what the host does
 * between its calls (round_kernel.py `greedy_rounds`), so each round is the round the host would have run. g[0] and
 * g[1]: the rounds (widths K) after a round with a draft rejected and after a fully accepted one (`auto` may draft
 * apart by that state; the same round twice at a fixed k); `full`: the state the first round starts in (a round with
 * no drafts keeps it). Before each round the row's position on the host (*starts[s] of the round's plan) is `pos`, then
 * the last round's plus the tokens it kept, and the draft chain's depth 1 reads the pending positions the last round left
 * (*width[s] = pend_n). Round i's record lands at outs + i (KM + 3), KM the wider K: its K, its tokens and n (K + 2).
 * It stops after a round that emitted one of the `stop` tokens (nstop of them), when fewer than K + 1 tokens are `left`
 * for the next round (it could not use all K drafts: the host's rounds run that one), or when its positions would pass
 * `slots`. -> 0 with the rounds run in *done, each one's nanoseconds in round_ns and those of the draft chains in all
 * in *draft_ns, or a round's failing status (greedy_round's; *done: the rounds before it). */
int greedy_rounds(GreedyRound* const* g, int64_t full, int64_t rounds, const int64_t* stop, int64_t nstop, int64_t left,
                  int64_t pos, int64_t slots, int64_t* const* starts, int64_t* const* width, int64_t* outs,
                  int64_t* round_ns, int64_t* done, int64_t* draft_ns) {
    const int64_t KM = g[0]->acc.K > g[1]->acc.K ? g[0]->acc.K : g[1]->acc.K;
    int64_t* const out[2] = {g[0]->acc.out, g[1]->acc.out};
    *done = *draft_ns = 0;
    g[0]->stage = g[1]->stage = 0; /* (a failing round leaves its stage; the other plan's says 0) */
    int status = 0;
    for (int64_t i = 0; i < rounds; i++) {
        GreedyRound* r = g[full != 0];
        const int64_t K = r->acc.K;
        if (left < K + 1 || pos + K + 1 > slots) break;
        *starts[full != 0] = pos;
        if (K > 0) *width[full != 0] = r->acc.pend_n[0];
        int64_t* rec = outs + i * (KM + 3);
        rec[0] = K;
        r->acc.out = rec + 1;
        status = greedy_round(r);
        if (status) break;
        round_ns[i] = r->round_ns;
        *done = i + 1;
        *draft_ns += r->draft_ns;
        const int64_t* tok = rec + 1;
        const int64_t n = tok[K + 1];
        pos += n + 1;
        left -= n + 1;
        if (K > 0) full = n == K;
        int stopped = 0;
        for (int64_t s = 0; s <= n && !stopped; s++)
            for (int64_t j = 0; j < nstop; j++) stopped |= tok[s] == stop[j];
        if (stopped) break;
    }
    g[0]->acc.out = out[0];
    g[1]->acc.out = out[1];
    return status;
}
